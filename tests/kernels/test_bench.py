"""The GPU benchmark script's own logic, on tiny shapes in the Triton interpreter."""
from __future__ import annotations

import json
import sys

import pytest

from kernels.bench import peak_hbm_gbps

from .conftest import HAS_CUDA


def test_peak_bandwidth_table():
    assert peak_hbm_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert peak_hbm_gbps("NVIDIA H100 PCIe") == 2000.0
    assert peak_hbm_gbps("NVIDIA H200") == 4800.0
    assert peak_hbm_gbps("NVIDIA A100-SXM4-80GB") == 2039.0
    assert peak_hbm_gbps("Some Future GPU") is None


@pytest.mark.skipif(HAS_CUDA, reason="--smoke runs the interpreter; CUDA runs the real bench")
def test_bench_smoke_writes_report(tmp_path, monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed")
    from kernels import bench

    out = tmp_path / "kernels.json"
    monkeypatch.setattr(sys, "argv", [
        "bench", "--smoke", "--shape", "smollm2-135m", "--batches", "2", "--contexts", "32",
        "--prefill-lengths", "16", "--prefill-tokens", "32", "--peak-gbps", "100",
        "--out", str(out)])
    bench.main()
    report = json.loads(out.read_text())
    (decode,) = report["decode"]
    assert decode["batch"] == 2 and decode["context"] == 32 and decode["max_abs_diff"] < 0.05
    assert decode["kv_bytes"] == 2 * 2 * 32 * 3 * 64 * 2  # K and V, bf16
    (prefill,) = report["prefill"]
    assert prefill["mode"] == "prompt" and prefill["batch"] == 2 and prefill["triton_tflops"] > 0
