"""scripts/bench_sampling.py runs small on the built-in model and writes what it prints; its
switch really moves random rows and logprobs between the kernel and the torch path (nothing
here is timed)."""
from __future__ import annotations

import json

import pytest
import torch

from kernels import sampling as cpu_sampling
from scripts import bench_sampling

pytestmark = pytest.mark.skipif(not cpu_sampling.available(), reason="no C compiler")


def test_the_benchmark_writes_both_paths_for_every_setting(tmp_path, capsys):
    out = tmp_path / "sampling.json"
    assert bench_sampling.main(["--batches", "2", "--repeats", "1", "--capture-prompts", "2",
                                "--capture-tokens", "3", "--concurrency", "2", "--max-tokens",
                                "3", "--rounds", "1", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["captured_rows"] == 2 * 3 and got["threads"] == 1 and not got["neighbour"]
    assert [r["setting"] for r in got["sampler"]] == list(bench_sampling.SETTINGS)
    assert all(r["kernel_ms"] > 0 and r["torch_ms"] > 0 for r in got["sampler"])
    assert got["prompt_logprobs"]["rows"] == 6 and got["prompt_logprobs"]["kernel_ms"] > 0
    engine = got["engine"]
    assert [r["path"] for r in engine] == ["kernel", "torch"]
    # prompts are not timed: 3 tokens each, the first from the prefill
    assert all(r["output_tokens"] == 2 * 2 and r["steps"] == 2 for r in engine)
    assert "T0.7 p0.9" in capsys.readouterr().out


def test_the_switch_moves_random_rows_off_the_kernel(monkeypatch):
    from services.engine.sampler import sample

    logits = torch.randn(3, 64)
    batch = bench_sampling.sampling_batch(logits, {"temperature": 0.7, "top_p": 0.9}, 0)
    calls = []
    for name in ("sample_rows", "logprobs_rows"):
        real = getattr(cpu_sampling, name)
        monkeypatch.setattr(cpu_sampling, name,
                            lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    with_logprobs = bench_sampling.sampling_batch(logits, {"temperature": 0, "logprobs": 2}, 0)
    with bench_sampling.kernel(False):
        sample(logits, batch), sample(logits, with_logprobs)
    assert not calls
    with bench_sampling.kernel(True):
        sample(logits, batch), sample(logits, with_logprobs)
    assert calls == ["sample_rows", "logprobs_rows"]
