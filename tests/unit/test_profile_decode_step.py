"""scripts/profile_decode_step.py runs small and writes the figures it prints (the real numbers
are taken on a quiet machine; nothing here is timed)."""
from __future__ import annotations

import json
import sys

from scripts import profile_decode_step


def test_profile_writes_cpu_time_ops_and_phases_per_batch(tmp_path, monkeypatch, capsys):
    out = tmp_path / "profile.json"
    monkeypatch.setattr(sys, "argv", ["profile_decode_step", "--batches", "1,3", "--warmup", "1",
                                      "--steps", "2", "--profile-steps", "1", "--top", "3",
                                      "--out", str(out)])
    profile_decode_step.main()
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["cpu_ms_per_step"] > 0
        assert row["aten_ops_per_step"] > 0
        assert set(row["phase_cpu_ms_per_step"]) == {"schedule", "prepare_inputs", "forward",
                                                     "sample", "postprocess", "engine_rest"}
        assert 0 < len(row["top_ops"]) <= 3
    assert "batch   3:" in capsys.readouterr().out


def test_ops_and_host_reads_per_decode_step_do_not_grow_with_the_batch():
    """Every sampler path in every step (``--sampling mixed``): the same aten ops at 8, 16 and
    32 sequences, and one device-to-host read of the sampled tokens per step. (From 8: with a
    single row of a kind, torch's ``logsumexp`` takes another internal path, 2 views more.)"""
    e = profile_decode_step.make_engine("float32", "auto", 32)
    rows = [profile_decode_step.profile_batch(e, b, warmup=1, steps=1, profile_steps=2, top=1,
                                              seed=b, sampling="mixed") for b in (8, 16, 32)]
    assert len({r["aten_ops_per_step"] for r in rows}) == 1, [r["aten_ops_per_step"] for r in rows]
    assert all(r["host_reads_per_step"] == 1 for r in rows)


def test_chat_sampling_draws_every_row_at_random_with_flat_ops():
    """``--sampling chat``: every row seeded temperature 0.7 + top-p 0.9, the same aten ops at 8
    and 16 sequences (random rows sample in one call, not one per row)."""
    params = profile_decode_step.sampling_params("chat", 3, 10)
    assert (params.temperature, params.top_p, params.seed, params.max_tokens) == (0.7, 0.9, 3, 10)
    e = profile_decode_step.make_engine("float32", "auto", 16)
    rows = [profile_decode_step.profile_batch(e, b, warmup=1, steps=1, profile_steps=2, top=1,
                                              seed=b, sampling="chat") for b in (8, 16)]
    assert rows[0]["aten_ops_per_step"] == rows[1]["aten_ops_per_step"]
    assert all(r["host_reads_per_step"] == 1 for r in rows)


def test_queued_copies_are_not_counted_as_host_syncs():
    """A step that queues copies and waits once: 1 sync and 3 copies, not 4 syncs (cudaMemcpy
    is the synchronous copy; cudaMemcpyAsync only shares its prefix)."""
    from types import SimpleNamespace as Event

    events = [Event(key="cudaMemcpyAsync", count=3), Event(key="cudaStreamSynchronize", count=1),
              Event(key="cuLaunchKernelEx", count=5), Event(key="cudaLaunchKernel", count=2),
              Event(key="aten::copy_", count=4)]
    assert profile_decode_step.count_calls(events, profile_decode_step.SYNC_EVENTS) == 1
    assert profile_decode_step.count_calls(events, profile_decode_step.COPY_EVENTS) == 3
    assert profile_decode_step.count_calls(events, profile_decode_step.LAUNCH_EVENTS) == 7


def test_the_host_s_wait_is_the_synchronising_calls_time_only():
    """host_wait_ms_per_step sums the CPU time of the synchronising CUDA calls (microseconds in
    the profiler): not the queued copies' or the launches', which are the host's own work."""
    from types import SimpleNamespace as Event

    events = [Event(key="cudaMemcpyAsync", cpu_time_total=40.0),
              Event(key="cudaStreamSynchronize", cpu_time_total=900.0),
              Event(key="cudaEventSynchronize", cpu_time_total=100.0),
              Event(key="cudaLaunchKernel", cpu_time_total=250.0)]
    assert profile_decode_step.calls_ms(events, profile_decode_step.SYNC_EVENTS) == 1.0
    assert profile_decode_step.calls_ms(events, profile_decode_step.LAUNCH_EVENTS) == 0.25


def test_api_calls_are_the_host_side_cuda_calls_most_time_first():
    """top_api_calls: the host events named cuda*/cu* (runtime and driver calls), by their CPU
    time; not aten ops, and not the kernels, whose events are the device's."""
    from types import SimpleNamespace as Event

    import torch

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = [Event(key="cudaMemcpyAsync", cpu_time_total=40.0, device_type=cpu),
              Event(key="cudaGraphLaunch", cpu_time_total=90.0, device_type=cpu),
              Event(key="cuLaunchKernelEx", cpu_time_total=60.0, device_type=cpu),
              Event(key="aten::copy_", cpu_time_total=500.0, device_type=cpu),
              Event(key="cutlass_gemm_kernel", cpu_time_total=0.0, device_type=cuda)]
    assert [a.key for a in profile_decode_step.api_calls(events)] == [
        "cudaGraphLaunch", "cuLaunchKernelEx", "cudaMemcpyAsync"]
