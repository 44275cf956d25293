"""Where the CPU kernels' shared libraries (``csrc/*.c``) come from: built ahead of time for CPU
families (what the image ships), or compiled on first use for this very CPU (a checkout).

- **Prebuilt** (``python -m kernels.cpu_kernels prebuild``, run by the image build): every
  ``csrc/*.c`` once per family of ``FAMILIES`` into ``prebuilt_dir()``
  (``<sys.prefix>/lib/tandem-kernels``), named ``<stem>-<family>-<digest>.so``; the digest
  covers the source, the headers beside it and the flags, so a library built from other sources
  is never picked. At run time the best family this CPU supports (``/proc/cpuinfo`` flags) wins,
  then the next best: a runtime dispatch by shared library, as llama.cpp's
  ``GGML_CPU_ALL_VARIANTS`` loads one backend per CPU variant. No compiler is needed.
- **Built here**: with no prebuilt library, ``shared_library`` compiles with the caller's flags
  (``-march=native``) into ``cache_dir()`` (``$TANDEM_CACHE_DIR/kernels``, default
  ``~/.cache/tandem/kernels``), keyed by the source, headers, compiler, flags and this CPU.

Every outcome is recorded (``outcomes()``); ``kernels.cpu_kernels`` reports them at a worker's
start. This module takes the flags from its callers and imports no other kernel module, nor
anything of ``services``.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")


@dataclass(frozen=True)
class Family:
    """A CPU family the kernels are prebuilt for: ``march`` replaces ``-march=native`` in the
    compile flags; a CPU runs the build when its ``/proc/cpuinfo`` flags include ``requires``."""

    name: str
    march: tuple[str, ...]
    requires: frozenset[str]


_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# worst first. x86-64-v3: Haswell, Zen 1 on; x86-64-v4: Skylake-SP; +VNNI: Cascade Lake, Ice
# Lake; +BF16: Cooper Lake, Sapphire Rapids, Zen 4 (the kernels' paths: AVX2, AVX-512, VNNI)
FAMILIES: dict[str, tuple[Family, ...]] = {
    "x86_64": (
        Family("x86_64", ("-march=x86-64",), frozenset()),
        Family("avx2", ("-march=x86-64-v3",), _V3),
        Family("avx512", ("-march=x86-64-v4",), _V4),
        Family("avx512_vnni", ("-march=x86-64-v4", "-mavx512vnni"), _V4 | {"avx512_vnni"}),
        Family("avx512_bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
               _V4 | {"avx512_vnni", "avx512_bf16"}),
    ),
    "aarch64": (Family("armv8", ("-march=armv8-a",), frozenset()),),
}

_outcomes: dict[str, str] = {}  # kernel (source stem) -> how its library was found, or why not


def cache_dir() -> Path:
    """Where libraries built here live: ``$TANDEM_CACHE_DIR/kernels`` or
    ``~/.cache/tandem/kernels``."""
    root = os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem"
    return Path(root) / "kernels"


def prebuilt_dir() -> Path:
    """Where prebuilt libraries live: ``<sys.prefix>/lib/tandem-kernels`` (the image's venv)."""
    return Path(sys.prefix) / "lib" / "tandem-kernels"


def families(machine: str | None = None) -> tuple[Family, ...]:
    """The families prebuilt for ``machine`` (default: this one's, ``platform.machine()``),
    worst first; empty for a machine without any."""
    return FAMILIES.get(machine or platform.machine(), ())


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux reports them (``/proc/cpuinfo``); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def runnable_families(flags: frozenset[str] | None = None) -> list[Family]:
    """The families a CPU with ``flags`` (default: this one) can run, best first."""
    flags = cpu_flags() if flags is None else flags
    return [f for f in reversed(families()) if f.requires <= flags]


def _cpu_id() -> str:
    """The CPU model and flags (``-march=native`` code is only valid on such a CPU)."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return "\n".join(sorted({ln for ln in info if ln.startswith(("model name", "flags"))}))


def _digest(source: Path, *parts: str) -> str:
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]
    return hashlib.sha256(b"\0".join([source.read_bytes(), *headers,
                                      *(p.encode() for p in parts)])).hexdigest()[:16]


def family_flags(cflags: tuple[str, ...], family: Family) -> tuple[str, ...]:
    """``cflags`` with ``-march=native`` replaced by the family's ``march`` flags."""
    return tuple(f for f in cflags if not f.startswith("-march=")) + family.march


def prebuilt_name(source: Path, family: Family, cflags: tuple[str, ...],
                  ldflags: tuple[str, ...]) -> str:
    """The file name of ``source``'s library prebuilt for ``family`` with these flags."""
    flags = " ".join((*family_flags(cflags, family), *ldflags))
    return f"{source.stem}-{family.name}-{_digest(source, flags)}.so"


def find_prebuilt(source: Path, cflags: tuple[str, ...], ldflags: tuple[str, ...],
                  flags: frozenset[str] | None = None) -> tuple[Path, Family] | None:
    """The prebuilt library of ``source`` (built from these sources and flags) for the best
    family a CPU with ``flags`` (default: this one) runs, and that family; ``None`` if none."""
    root = prebuilt_dir()
    if not root.is_dir():
        return None
    for family in runnable_families(flags):
        path = root / prebuilt_name(source, family, cflags, ldflags)
        if path.is_file():
            return path, family
    return None


def compile_library(cc: str, cflags: tuple[str, ...], ldflags: tuple[str, ...], source: Path,
                    target: Path) -> Path:
    """Compile ``source`` into the shared library ``target``; returns ``target``.

    Raises ``RuntimeError`` with the compiler's output when it fails, ``OSError`` when
    ``target``'s folder cannot be written. Safe under concurrent builds: each compiles into a
    temporary folder beside ``target`` and renames the result into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / target.name
        for cmd in ([cc, *cflags, "-c", str(source), "-o", str(obj)],
                    [cc, *ldflags, str(obj), "-o", str(lib), "-lm"]):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"building {source.name} failed: {' '.join(cmd)}\n"
                                   f"{proc.stderr.strip()}")
        os.replace(lib, target)
    return target


def _compiler(compiler: str | None) -> str | None:
    import shutil

    return compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def shared_library(source: Path, cflags: tuple[str, ...], ldflags: tuple[str, ...],
                   compiler: str | None = None) -> Path:
    """The shared library of the C file ``source``: the prebuilt one for the best family this
    CPU runs, else one compiled here with ``cflags``/``ldflags`` and cached in ``cache_dir()``
    (compiled only once per source, headers, compiler, flags and CPU). A ``compiler`` given
    skips the prebuilt libraries (always compiles here).

    Raises ``RuntimeError`` (with the compiler's output) when no prebuilt library fits, no
    compiler is found or the build fails; ``OSError`` when the cache cannot be written or the
    library does not load (a missing ``libgomp.so.1``, say). Either is recorded for
    ``outcomes()``."""
    try:
        if compiler is None and (found := find_prebuilt(source, cflags, ldflags)):
            target, how = found[0], f"prebuilt for {found[1].name}"
        else:
            cc = _compiler(compiler)
            if not cc:
                raise RuntimeError(_no_compiler_message())
            key = _digest(source, " ".join((cc, *cflags, *ldflags)), _cpu_id())
            target = cache_dir() / f"{source.stem}-{key}.so"
            how = f"built here ({' '.join(f for f in cflags if f.startswith('-march='))})"
            if not target.exists():
                compile_library(cc, cflags, ldflags, source, target)
        ctypes.CDLL(str(target))  # fails here, recorded, rather than in the caller
    except (RuntimeError, OSError) as exc:
        _outcomes[source.stem] = f"not loaded: {exc}"
        raise
    _outcomes[source.stem] = f"{how}, {target}"
    return target


def _no_compiler_message() -> str:
    fams = families()
    runnable = [f.name for f in runnable_families()]
    if not prebuilt_dir().is_dir():
        where = f"no prebuilt kernels ({prebuilt_dir()} does not exist)"
    elif not runnable:
        where = (f"this CPU runs none of the prebuilt families "
                 f"({', '.join(f.name for f in fams) or 'none for ' + platform.machine()})")
    else:
        where = (f"no prebuilt library in {prebuilt_dir()} matches these sources and flags for "
                 f"{', '.join(runnable)}")
    return f"{where}, and no C compiler found (set $CC, or install gcc)"


def outcomes() -> dict[str, str]:
    """Each kernel tried in this process (source stem) -> how its library was found (``prebuilt
    for avx512_vnni``, ``built here (-march=native), PATH``) or ``not loaded: REASON``."""
    return dict(_outcomes)


def prebuild(out: Path, cflags: tuple[str, ...], ldflags: tuple[str, ...],
             names: list[str] | None = None, compiler: str | None = None,
             jobs: int | None = None) -> list[Path]:
    """Compile every ``csrc/*.c`` for each family (``names``, default all of this machine's)
    into ``out``; returns the libraries written. Raises ``RuntimeError`` naming an unknown
    family, a missing compiler or a failed build."""
    by_name = {f.name: f for f in families()}
    unknown = sorted(set(names or ()) - set(by_name))
    if unknown or not by_name:
        raise RuntimeError(f"families: {', '.join(unknown) or 'none'} unknown for "
                           f"{platform.machine()} (known: {', '.join(by_name) or 'none'})")
    cc = _compiler(compiler)
    if not cc:
        raise RuntimeError("no C compiler found (set $CC, or install gcc)")
    chosen = [by_name[n] for n in names] if names else list(by_name.values())
    jobs_list = [(s, f) for s in sorted(CSRC.glob("*.c")) for f in chosen]

    def build(job: tuple[Path, Family]) -> Path:
        source, family = job
        return compile_library(cc, family_flags(cflags, family), ldflags, source,
                               out / prebuilt_name(source, family, cflags, ldflags))

    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        return list(pool.map(build, jobs_list))
