"""The packages a lent GPU machine must be given as wheels (``scripts/gpu_prepare.sh``): every
distribution Tandem needs at run time, found by walking ``tandem``'s installed requirements
(extras and other platforms' markers left out), less the packages the GPU image holds, each at
the version installed here. grpcio and protobuf go even though the image has them: its grpcio
(1.84) is older than the one the generated stubs were made with. torch, triton and numpy never
go: the image's are built for its CUDA.

    python -m scripts.gpu_wheels KINDS_MD     # prints NAME==VERSION lines

``KINDS_MD``: the tool library's device/KINDS.md, whose "Packages:" list names the image's
packages. Raises ValueError when the file has no such line, PackageNotFoundError when Tandem is
not installed.
"""
from __future__ import annotations

import re
import sys
from importlib import metadata

from packaging.requirements import Requirement

ALWAYS = frozenset({"grpcio", "protobuf"})  # the image's are too old
NEVER = frozenset({"torch", "triton", "numpy"})  # the image's match its CUDA


def norm(name: str) -> str:
    """A distribution name as PEP 503 normalises it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(kinds_md: str) -> set[str]:
    """The normalised names listed after "Packages:" in KINDS.md's text (to the paragraph's
    end). Raises ValueError when there is no such list."""
    match = re.search(r"Packages:(.*?)(?:\n\s*\n|$)", kinds_md, re.DOTALL)
    if match is None:
        raise ValueError("KINDS.md: no 'Packages:' line")
    names = match.group(1).replace("\n", " ").split(",")
    return {norm(n.strip().rstrip(".")) for n in names if n.strip()}


def wheels(image: set[str], root: str = "tandem") -> list[str]:
    """``NAME==VERSION`` of every run-time requirement of ``root`` (transitively, as installed)
    that ``image`` lacks, plus ``ALWAYS``, less ``NEVER``; sorted."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in metadata.requires(root) or []]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's, or another platform's
        name = norm(req.name)
        if name in seen or name in NEVER or (name in image and name not in ALWAYS):
            continue
        seen.add(name)
        todo += [Requirement(r) for r in metadata.requires(req.name) or []]
    return [f"{name}=={metadata.version(name)}" for name in sorted(seen)]


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        print("\n".join(wheels(image_packages(f.read()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
