"""Every Triton kernel compiles for the GPUs the project runs on (H100/H200, sm_90) without a
GPU: ``tests/kernels/compile_for_gpu.py`` in a process without ``TRITON_INTERPRET``, so a
compile error that the interpreter lets through shows here, not in a device session."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_every_triton_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile every kernel here, none from a cache
    run = subprocess.run([sys.executable, "-m", "tests.kernels.compile_for_gpu", "90"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    kernels = {line.split(": ")[1] for line in run.stdout.splitlines() if "bytes of cubin" in line}
    # every kernel the package defines (helpers called from kernels are not launched alone)
    defined = {name for path in (ROOT / "kernels").glob("*.py")
               for name in re.findall(r"@triton\.jit\s*\ndef (\w+_kernel)\(", path.read_text())}
    assert len(defined) == 9 and kernels == defined, (kernels, defined)
