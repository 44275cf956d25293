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
        "--table-width", "512", "--split-programs", "0", "1", "--merge", "kernel", "fused",
        "--out", str(out)])
    bench.main()
    report = json.loads(out.read_text())
    decode, fused, one_program, _ = report["decode"]
    assert (decode["merge"], fused["merge"]) == ("kernel", "fused")
    assert fused["max_abs_diff"] < 0.05 and fused["split_programs"] == 2
    assert decode["batch"] == 2 and decode["context"] == 32 and decode["max_abs_diff"] < 0.05
    assert decode["kv_bytes"] == 2 * 2 * 32 * 3 * 64 * 2  # K and V, bf16
    # 512-token tables: 4 splits of two 64-key tiles; the interpreter's one "multiprocessor"
    # gets about 8 programs over 2 x 3 rows: 2 a row; or the 1 asked for
    assert decode["num_splits"] == 4 and decode["split_programs"] == 2
    assert one_program["split_programs"] == 1 and one_program["max_abs_diff"] < 0.05
    (prefill,) = report["prefill"]
    assert prefill["mode"] == "prompt" and prefill["batch"] == 2 and prefill["triton_tflops"] > 0
    assert prefill["block_m"] is None and prefill["max_abs_diff"] == 0.0


@pytest.mark.skipif(HAS_CUDA, reason="--smoke runs the interpreter; CUDA runs the real bench")
def test_bench_prefill_configs_side_by_side(tmp_path, monkeypatch):
    """A sweep's configs run on the same inputs: one row each, with its tuning keywords, and
    outputs that agree with the first config's to the tile order's rounding."""
    pytest.importorskip("triton", reason="triton is not installed")
    from kernels import bench

    out = tmp_path / "kernels.json"
    monkeypatch.setattr(sys, "argv", [
        "bench", "--smoke", "--shape", "smollm2-135m", "--batches", "1", "--contexts", "16",
        "--prefill-lengths", "40", "--prefill-tokens", "40", "--peak-gbps", "100",
        "--prefill-configs", "default", "16x16x0x0", "32x32x4x2", "--out", str(out)])
    bench.main()
    rows = json.loads(out.read_text())["prefill"]
    assert [(r["block_m"], r["block_n"], r["num_warps"], r["num_stages"]) for r in rows] == [
        (None, None, None, None), (16, 16, None, None), (32, 32, 4, 2)]
    assert all(r["triton_tflops"] > 0 and r["max_abs_diff"] < 0.05 for r in rows)
    assert len({r["sdpa_tflops"] for r in rows}) == 1  # SDPA timed once, beside every config


def test_prefill_config_form():
    from kernels.bench import parse_prefill_config

    assert parse_prefill_config("default") == {}
    assert parse_prefill_config("128x64x8x3") == {"block_m": 128, "block_n": 64, "num_warps": 8,
                                                  "num_stages": 3}
    assert parse_prefill_config("64x0x4x0") == {"block_m": 64, "num_warps": 4}
    with pytest.raises(ValueError, match="BMxBNxWxS"):
        parse_prefill_config("128x64")
