"""Offline benchmark: seeded workloads with the target length distributions, HF output counting,
target marks, and a ``--quick`` run end to end on a few tiny requests per system."""
from __future__ import annotations

import json
import statistics

import pytest
import torch

from loadtest import offline, offline_report
from loadtest.chat_prompts import CHAT_PROMPTS
from loadtest.hf_baseline import _own_output_tokens
from loadtest.workloads import BenchRequest, chat_workload, random_workload
from services.engine.metrics import STEP_PHASES
from tests.reference import tokenizer


def test_random_workload_is_seeded_and_reproducible():
    assert random_workload(50, seed=3) == random_workload(50, seed=3)
    assert random_workload(50, seed=3) != random_workload(50, seed=4)


def test_random_workload_follows_a_sharegpt_like_distribution():
    w = random_workload(2000, seed=0, vocab_size=49152)
    prompts = [len(r.prompt_token_ids) for r in w.requests]
    outputs = [r.max_tokens for r in w.requests]
    assert 85 <= statistics.median(prompts) <= 115
    assert 170 <= statistics.median(outputs) <= 210
    assert min(outputs) >= 8 and max(outputs) == 512
    assert max(prompts) <= 512 and min(prompts) >= 4
    assert all(r.ignore_eos for r in w.requests)
    assert all(17 <= t < 49152 for r in w.requests[:50] for t in r.prompt_token_ids)


def test_random_workload_clips_outputs_for_smoke_runs():
    w = random_workload(100, max_output=16)
    assert max(r.max_tokens for r in w.requests) <= 16


def test_chat_workload_renders_varied_prompts_with_the_chat_template():
    assert len(set(CHAT_PROMPTS)) >= 40
    tok = tokenizer()
    w = chat_workload(45, tok, seed=1)
    assert w == chat_workload(45, tok, seed=1)
    assert w != chat_workload(45, tok, seed=2)
    assert len({r.prompt_token_ids for r in w.requests}) == len(CHAT_PROMPTS)  # cycled past 42
    first = w.requests[0]
    assert first.prompt_token_ids[0] == 1  # <|im_start|>
    assert first.max_tokens == 512 and not first.ignore_eos


def test_num_prompts_spec():
    assert offline._num_prompts("7", quick=False) == {"random": 7, "chat": 7}
    assert offline._num_prompts("chat=3", quick=True)["chat"] == 3
    with pytest.raises(ValueError, match="num-prompts"):
        offline._num_prompts("bogus=3", quick=False)


def test_hf_counts_only_each_requests_own_tokens():
    chat = BenchRequest((1, 2, 3), max_tokens=5, ignore_eos=False)
    fixed = BenchRequest((1, 2, 3), max_tokens=3, ignore_eos=True)
    assert _own_output_tokens(chat, [7, 8, 2, 2, 2, 2], eos_id=2) == 3  # EOS included, padding not
    assert _own_output_tokens(chat, [7, 8, 9, 9, 9, 9], eos_id=2) == 5  # capped at max_tokens
    assert _own_output_tokens(fixed, [2, 8, 9, 9, 9], eos_id=2) == 3  # ignore_eos: exact length


def test_targets_mark_pass_and_fail():
    rows = [{"system": "continuous", "workload": "random", "output_tokens_per_s": 30.0, "kv_waste": 0.02},
            {"system": "static", "workload": "random", "output_tokens_per_s": 10.0, "kv_waste": 0.4}]
    rat = offline_report.ratios(rows)
    assert rat["continuous_vs_static_random"] == 3.0 and rat["continuous_vs_hf_random"] is None
    marks = {t["name"]: t["passed"] for t in offline_report.targets(
        rows, rat, {"overhead_pct": 12.0}, {"engine_tokens_per_s": 400.0})}
    assert marks == {"continuous_vs_static_random": True, "continuous_vs_hf_chat": None,
                     "kv_waste_continuous": True, "decode_overhead_pct": False,
                     "prefill_tokens_per_s": True}


ROW_FIELDS = {"system", "workload", "num_requests", "elapsed_s", "prompt_tokens", "output_tokens",
              "output_tokens_per_s", "total_tokens_per_s", "requests_per_s", "cpu_s",
              "output_tokens_per_cpu_s", *offline_report.ENGINE_ONLY}


@pytest.fixture
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_quick_run_end_to_end_reports_every_field(tmp_path, capsys, keep_torch_threads):
    out = tmp_path / "offline.json"
    # NOTE: one thread: tiny batches gain nothing from two, and on a CPU shared with other test
    # runs two OpenMP threads stall on each other's barriers (10x slower)
    rc = offline.main(["--quick", "--num-prompts", "2", "--max-output", "3", "--max-prompt", "32",
                       "--num-kv-blocks", "128", "--decode-batch", "4", "--decode-tokens", "3",
                       "--prefill-tokens", "24", "--threads", "1", "--out", str(out)])
    assert rc == 0
    results = json.loads(out.read_text())
    runs = results["runs"]
    assert [(r["workload"], r["system"]) for r in runs] == [
        (w, s) for w in ("random", "chat") for s in ("continuous", "static", "hf")]
    for r in runs:
        assert ROW_FIELDS <= r.keys()
        assert r["output_tokens"] > 0 and r["output_tokens_per_s"] > 0
        if r["system"] != "hf":
            assert set(r["step_split_pct"]) == set(STEP_PHASES)
            assert 0 <= r["kv_waste"] < 1 and 0 < r["kv_usage"] <= 1 and r["mean_batch_size"] > 0
    # random outputs are exact (ignore_eos), clipped to 3 tokens: 2 requests give 6 in every system
    assert {r["output_tokens"] for r in runs if r["workload"] == "random"} == {6}
    assert results["decode_probe"]["mean_batch_size"] == 4
    assert results["machine"]["other_cpu_cores"] >= 0
    assert results["prefill_probe"]["engine_tokens_per_s"] > 0
    assert results["prefill_probe"]["hf_tokens_per_s"] > 0
    assert [t["name"] for t in results["targets"]] == [t[0] for t in offline_report.TARGETS]
    assert results["ratios_per_cpu_s"]["continuous_vs_static_random"] > 0
    assert "targets:" in capsys.readouterr().out


def test_chat_floor_replays_the_same_schedule(tmp_path, keep_torch_threads):
    """The attention-free run must reproduce the real run's schedule (the script asserts it),
    and every computed token is counted in some step."""
    from loadtest import chat_floor

    out = tmp_path / "floor.json"
    # a small token budget admits the prompts one after another: the later ones hit the
    # prefix cache on the chat template's first block
    assert chat_floor.main(["--num-prompts", "3", "--max-output", "6", "--threads", "1",
                            "--max-num-batched-tokens", "48", "--hf-seconds", "100",
                            "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    prompts = [len(w.prompt_token_ids) for w in chat_workload(3, tokenizer(), seed=0).requests]
    # the last sampled token of each request is never fed back, so its KV is never computed;
    # prefix-cache hits (whole blocks of the shared template) are not computed either
    assert sum(r["step_tokens"]) == (sum(prompts) + sum(r["output_lens"]) - 3
                                     - r["prefix_cache_hit_tokens"])
    assert r["output_tokens"] == sum(r["output_lens"]) and max(r["output_lens"]) <= 6
    assert r["num_steps"] == len(r["step_tokens"])
    assert 0 < r["gemm_s"] and 0 < r["attention_floor_s"] and r["copy_gbps"] > 0
    assert r["budget_for_4x_s"] == 25.0
    assert r["prefix_cache_hit_tokens"] > 0 and r["prefix_cache_hit_tokens"] % 16 == 0


def test_other_cpu_work_is_measured_from_proc_stat():
    """A busy child process (outside this one) is counted as other work: at least the CPU time
    the child itself used (its own rusage), whatever else the machine runs at the same time,
    and never more than every core busy for the whole interval."""
    import os
    import resource
    import subprocess
    import sys
    import time

    before = offline_report.cpu_seconds()
    if before is None:
        pytest.skip("no /proc/stat on this platform")
    child_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # NOTE: the child spins for 0.5 s of its own CPU time, not of wall time: on a loaded machine
    # it gets fewer cycles per wall second, never fewer CPU-seconds in all
    subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 0.5: pass"],
                   check=True)
    wall = time.perf_counter() - t0
    other = offline_report.other_cpu_cores(before, wall)
    child_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    child_cpu = ((child_after.ru_utime + child_after.ru_stime)
                 - (child_before.ru_utime + child_before.ru_stime))
    assert child_cpu >= 0.5
    tick_s = 1 / os.sysconf("SC_CLK_TCK")  # /proc/stat counts whole ticks per core
    num_cores = os.cpu_count() or 1
    assert other * wall >= child_cpu - 2 * num_cores * tick_s, (other, wall, child_cpu)
    assert other <= num_cores + 2 * num_cores * tick_s / wall, (other, num_cores)
    assert offline_report.cpu_shared({"other_cpu_cores": 0.5})
    assert not offline_report.cpu_shared({"other_cpu_cores": 0.1})
    assert not offline_report.cpu_shared({"other_cpu_cores": None})
