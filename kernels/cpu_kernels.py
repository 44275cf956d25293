"""The four CPU C kernels as one unit: prebuilt for every CPU family (the image build), loaded
at a worker's start and reported.

    python -m kernels.cpu_kernels prebuild [--out DIR] [--families a,b]   the image's kernel layer
    python -m kernels.cpu_kernels status                                   what this CPU loads

``log_loaded()`` loads ``paged_decode_attention``, ``quant_matmul``, ``decode_ops`` and
``sampling`` now (at a worker's start, not at its first request) and logs which build each
uses, or a WARNING naming each kernel that could not be loaded, why, what that costs and how to
fix it: the torch fallbacks serve correctly but several times slower, which must not go
unnoticed. The libraries' origin (prebuilt or built here) is ``kernels.native``'s. Imports nothing of ``services``.
"""
from __future__ import annotations

import argparse
import logging
import platform
import sys
from pathlib import Path

from kernels import native

log = logging.getLogger(__name__)


def log_loaded() -> bool:
    """Load the four CPU kernels and log how (INFO), or which did not load and why (WARNING).
    Returns whether all four loaded."""
    from kernels import cpu_attention, decode_ops, quant, sampling

    loaded = {"paged_decode_attention": cpu_attention.available(),
              "quant_matmul": quant.available(), "decode_ops": decode_ops.available(),
              "sampling": sampling.available()}
    seen = native.outcomes()
    if all(loaded.values()):
        log.info("CPU kernels: %s", "; ".join(f"{k} {seen.get(k, 'loaded')}" for k in loaded))
        return True
    missing = [k for k, ok in loaded.items() if not ok]
    log.warning(
        "CPU KERNELS NOT LOADED: %s. This process serves with the torch fallbacks instead: "
        "GGUF weights are expanded to dense float (quantization auto resolves to none) and "
        "decode and random sampling are several times slower. Fix: run on a CPU the image's "
        "prebuilt kernels cover (%s), or give the process a C compiler and a writable "
        "$TANDEM_CACHE_DIR.",
        "; ".join(f"{k} ({seen.get(k, 'not loaded')})" for k in missing),
        ", ".join(f.name for f in native.families()) or f"none for {platform.machine()}")
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.cpu_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("prebuild", help="compile every kernel for each CPU family")
    pre.add_argument("--out", type=Path, default=native.prebuilt_dir(),
                     help="folder of the libraries (default: %(default)s)")
    pre.add_argument("--families", help="comma-separated (default: all of this machine's: "
                     f"{', '.join(f.name for f in native.families())})")
    sub.add_parser("status", help="load the kernels and print which build each uses")
    args = parser.parse_args(argv)
    if args.command == "prebuild":
        from kernels.cpu_attention import CFLAGS, LDFLAGS

        names = args.families.split(",") if args.families else None
        for path in native.prebuild(args.out, CFLAGS, LDFLAGS, names):
            print(path)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return 0 if log_loaded() else 1


if __name__ == "__main__":
    sys.exit(main())
