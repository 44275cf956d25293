"""The CUDA image's pins share one CUDA major: the base image (the Dockerfile's ``CUDA_BASE``),
torch, triton and NIXL (``docker/cuda-constraints.txt``), as the packages' own metadata says.

    python scripts/cuda_pins.py             check, offline, against docker/cuda-metadata.json
    python scripts/cuda_pins.py --refresh   first resolve the pinned wheels' metadata on PyPI

``--refresh`` asks pip for the wheels the CUDA image would install (CPython 3.12, Ubuntu 24.04's;
manylinux x86_64) with ``pip install --dry-run --no-deps --report``: pip reads each wheel's
``METADATA`` file from the index (PEP 658) without downloading the wheel, and the file records
each package's ``Requires-Dist``. The check reads that committed file, so CI needs no network
(``tests/unit/test_cuda_pins.py`` runs it). What it checks:

- the metadata is of exactly the pinned versions (else: refresh);
- torch's CUDA requirements (``cuda-toolkit==13.0.3``, ``cuda-bindings``, ``nvidia-*-cu13``) and
  the NIXL distribution's name (``nixl-cu13``) name the base image's CUDA major;
- the triton pin is the version torch's wheel requires;
- the torch pin is ``scripts/python_packages.sh``'s, and pyproject.toml's ``nixl`` and ``gpu``
  extras admit the pinned NIXL distribution and triton.

Exit status 1 with one line per disagreement.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "docker" / "cuda-constraints.txt"
METADATA = ROOT / "docker" / "cuda-metadata.json"
PYTHON_VERSION = "3.12"  # Ubuntu 24.04's python3, the CUDA base's
PLATFORM = "manylinux_2_28_x86_64"
_BASE = re.compile(r"^ARG CUDA_BASE=nvidia/cuda:(\d+)\.(\d+)\.(\d+)-[a-z-]+-ubuntu(\d+\.\d+)\s*$",
                   re.M)
_CU = re.compile(r"-cu(\d+)$")


def read_pins(text: str) -> dict[str, str]:
    """``name==version`` lines of a constraints file (comments and blanks skipped)."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            if spec.operator != "==":
                raise ValueError(f"{line}: a constraint here must be an exact pin (==)")
            pins[req.name.lower()] = spec.version
    return pins


def base_cuda_major(dockerfile: str) -> tuple[int, str]:
    """(CUDA major, the image) of the Dockerfile's ``ARG CUDA_BASE=nvidia/cuda:X.Y.Z-...``."""
    match = _BASE.search(dockerfile)
    if not match:
        raise ValueError("Dockerfile: no `ARG CUDA_BASE=nvidia/cuda:X.Y.Z-FLAVOUR-ubuntuNN.NN`")
    return int(match.group(1)), match.group(0).split("=", 1)[1].strip()


def cuda_majors(requires_dist: list[str]) -> dict[str, int]:
    """Each CUDA requirement of a wheel (name -> the CUDA major it asks for): ``nvidia-*-cuNN``
    by its name, ``cuda-toolkit`` and ``cuda-bindings`` by their version."""
    majors = {}
    for line in requires_dist:
        req = Requirement(line)
        name = req.name.lower()
        if name.startswith("nvidia-") and (m := _CU.search(name)):
            majors[name] = int(m.group(1))
        elif name in ("cuda-toolkit", "cuda-bindings", "cuda-python"):
            lows = [Version(s.version).major for s in req.specifier if s.operator in ("==", ">=",
                                                                                       "~=")]
            if lows:
                majors[name] = min(lows)
    return majors


def check(dockerfile: str, constraints: str, metadata: dict, pyproject: dict,
          packages_script: str) -> list[str]:
    """The disagreements among the CUDA pins (empty: they agree). Raises ``ValueError`` when a
    file lacks what it must declare."""
    problems = []
    major, base = base_cuda_major(dockerfile)
    pins = read_pins(constraints)
    nixl = [n for n in pins if n.startswith("nixl")]
    if "torch" not in pins or "triton" not in pins or len(nixl) != 1:
        raise ValueError(f"{CONSTRAINTS.name}: must pin torch, triton and one nixl-cuNN "
                         f"(has {sorted(pins)})")
    got = {name: info["version"] for name, info in metadata["packages"].items()}
    if got != pins:
        problems.append(f"{METADATA.name} is of {got}, the pins are {pins}: run "
                        "`python scripts/cuda_pins.py --refresh`")
        return problems
    torch_reqs = metadata["packages"]["torch"]["requires_dist"]
    for name, req_major in sorted(cuda_majors(torch_reqs).items()):
        if req_major != major:
            problems.append(f"torch {pins['torch']} requires {name} for CUDA {req_major}; the "
                            f"base image {base} is CUDA {major}")
    if not cuda_majors(torch_reqs):
        problems.append(f"torch {pins['torch']}'s wheel requires no CUDA packages (a CPU build?)")
    triton = [Requirement(r) for r in torch_reqs if Requirement(r).name.lower() == "triton"]
    if not triton or not triton[0].specifier.contains(pins["triton"]):
        problems.append(f"torch {pins['torch']} requires {triton[0] if triton else 'no triton'}; "
                        f"the pin is triton=={pins['triton']}")
    (nixl_name,) = nixl
    nixl_major = _CU.search(nixl_name)
    if not nixl_major or int(nixl_major.group(1)) != major:
        problems.append(f"{nixl_name} is not the CUDA {major} build of NIXL (nixl-cu{major})")
    script_torch = re.findall(r'"torch==([^"]+)"', packages_script)
    if set(script_torch) != {pins["torch"]}:
        problems.append(f"scripts/python_packages.sh installs torch {sorted(set(script_torch))}, "
                        f"the CUDA pin is {pins['torch']}")
    extras = pyproject["project"]["optional-dependencies"]
    nixl_extra = [Requirement(r) for r in extras.get("nixl", [])]
    if [r.name.lower() for r in nixl_extra] != [nixl_name] or not nixl_extra[0].specifier.contains(
            pins[nixl_name]):
        problems.append(f"pyproject.toml's nixl extra {[str(r) for r in nixl_extra]} does not "
                        f"admit {nixl_name}=={pins[nixl_name]}")
    gpu_triton = [Requirement(r) for r in extras.get("gpu", []) if r.startswith("triton")]
    if not gpu_triton or not gpu_triton[0].specifier.contains(pins["triton"]):
        problems.append(f"pyproject.toml's gpu extra {[str(r) for r in gpu_triton]} does not "
                        f"admit triton=={pins['triton']}")
    return problems


def check_repository() -> list[str]:
    """``check`` on this checkout's files."""
    return check((ROOT / "Dockerfile").read_text(), CONSTRAINTS.read_text(),
                 json.loads(METADATA.read_text()),
                 tomllib.loads((ROOT / "pyproject.toml").read_text()),
                 (ROOT / "scripts" / "python_packages.sh").read_text())


def refresh() -> dict:
    """Resolve the pinned wheels' metadata on PyPI (no wheel is downloaded) and write it."""
    pins = read_pins(CONSTRAINTS.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--quiet", "--dry-run",
               "--no-deps", "--ignore-installed", "--report", str(report),
               "--index-url", "https://pypi.org/simple", "--only-binary=:all:",
               "--platform", PLATFORM, "--python-version", PYTHON_VERSION, "--target", tmp,
               *(f"{n}=={v}" for n, v in pins.items())]
        if os.environ.get("PIP_CERT"):  # --isolated ignores the environment's settings
            cmd[5:5] = ["--cert", os.environ["PIP_CERT"]]
        subprocess.run(cmd, check=True)
        installs = json.loads(report.read_text())["install"]
    metadata = {
        "written_by": "python scripts/cuda_pins.py --refresh",
        "target": {"python_version": PYTHON_VERSION, "platform": PLATFORM},
        "packages": {
            item["metadata"]["name"].lower(): {
                "version": item["metadata"]["version"],
                "wheel": item["download_info"]["url"].rsplit("/", 1)[1],
                "requires_dist": item["metadata"].get("requires_dist", [])}
            for item in sorted(installs, key=lambda i: i["metadata"]["name"].lower())}}
    METADATA.write_text(json.dumps(metadata, indent=1) + "\n")
    return metadata


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refresh", action="store_true",
                        help=f"resolve the pins' metadata on PyPI into {METADATA.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    if args.refresh:
        refresh()
    problems = check_repository()
    for line in problems:
        print(f"cuda_pins: {line}", file=sys.stderr)
    if not problems:
        major, base = base_cuda_major((ROOT / "Dockerfile").read_text())
        pins = read_pins(CONSTRAINTS.read_text())
        print(f"cuda_pins: CUDA {major} throughout: {base}, "
              + ", ".join(f"{n}=={v}" for n, v in pins.items()))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
