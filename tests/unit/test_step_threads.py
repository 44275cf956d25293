"""StepThreads: which thread count small steps run on, learned from their times; and a served
engine's tokens do not depend on it."""

from __future__ import annotations

import logging

import pytest
import torch

from services.engine.step_threads import (EXPLORE_EVERY, FIRST_SAMPLES, MAX_EXPLORE_EVERY,
                                          StepThreads)


def run(chooser: StepThreads, num_tokens: int, ms_by_threads: dict[int, float], steps: int,
        ) -> list[int]:
    """Step ``steps`` times; a step on ``t`` threads takes ``ms_by_threads[t]``. The choices."""
    chosen = []
    for _ in range(steps):
        t = chooser.choose(num_tokens)
        chooser.record(num_tokens, t, ms_by_threads[t] / 1e3)
        chosen.append(t)
    return chosen


@pytest.mark.parametrize("fast", [1, 4])
@pytest.mark.parametrize("slow_ms,every", [(11.0, EXPLORE_EVERY), (20.0, 100),
                                           (60.0, MAX_EXPLORE_EVERY)])
def test_small_steps_settle_on_the_faster_count_and_retime_the_other(fast, slow_ms, every,
                                                                      caplog):
    """A 10% slower choice is re-timed every 32 steps; a 2x slower one every 100 (1% of the
    step time); a 6x slower one every 256 (the cap)."""
    chooser = StepThreads("auto", 4)
    slow = 4 if fast == 1 else 1
    ms = {fast: 10.0, slow: slow_ms}
    warm = 2 * (FIRST_SAMPLES + 1)
    with caplog.at_level(logging.INFO, logger="services.engine.step_threads"):
        chosen = run(chooser, 1, ms, warm + 4 * every)
    assert sorted(chosen[:warm]) == [1] * (warm // 2) + [4] * (warm // 2)  # each timed in turn
    after = chosen[warm:]
    assert after.count(slow) == 4 and after.count(fast) == len(after) - 4  # one in `every`
    assert [r.getMessage() for r in caplog.records] == [
        f"steps of 1 token(s) run on {fast} thread(s): 10.0 ms against {slow_ms} ms on {slow} "
        f"(re-timed every {every} steps)"]


def test_a_change_in_load_is_followed():
    chooser = StepThreads("auto", 2)
    run(chooser, 2, {1: 10.0, 2: 20.0}, 2 * (FIRST_SAMPLES + 1) + 100)
    assert chooser.choose(2) == 1
    # 2 threads became faster: seen at the next re-timing, within 100 steps (a 2x gap)
    later = run(chooser, 2, {1: 10.0, 2: 5.0}, 4 * 100)
    assert later[-100:].count(1) == 1  # only the one re-timing step in the window


def test_warm_up_step_is_not_counted():
    chooser = StepThreads("auto", 2)
    for t, ms in ((1, 500.0), (2, 500.0)):  # the first step of each choice: cold, ignored
        assert chooser.choose(1) == t
        chooser.record(1, t, ms / 1e3)
    run(chooser, 1, {1: 10.0, 2: 12.0}, 2 * FIRST_SAMPLES)
    assert chooser.choose(1) == 1 and chooser._ms[1, 1] == pytest.approx(10.0)


def test_buckets_of_every_size_learn_apart(caplog):
    """Prefill chunks and big batches are timed too: beside a busy neighbour one thread can win
    at any size (issue 27)."""
    chooser = StepThreads("auto", 2)
    warm = 2 * (FIRST_SAMPLES + 1)
    run(chooser, 1, {1: 10.0, 2: 20.0}, warm)
    run(chooser, 8, {1: 40.0, 2: 20.0}, warm)
    with caplog.at_level(logging.INFO, logger="services.engine.step_threads"):
        run(chooser, 2048, {1: 300.0, 2: 900.0}, warm + 1)
    assert (chooser.choose(1), chooser.choose(8), chooser.choose(2048)) == (1, 2, 1)
    assert chooser.choose(5) in (1, 2) and chooser._timed.get((3, 1)) is None  # 5: bucket 4-7
    assert chooser._timed[12, 1] > 0 and chooser._timed[12, 2] > 0  # 2048-4095
    assert "steps of 2048-4095 token(s) run on 1 thread(s)" in caplog.text


@pytest.mark.parametrize("mode,threads", [("all", 4), ("auto", 1)])
def test_all_or_one_thread_never_varies(mode, threads):
    chooser = StepThreads(mode, threads)
    assert set(run(chooser, 1, {threads: 1.0}, 100)) == {threads}


def test_unknown_mode_names_the_setting():
    with pytest.raises(ValueError, match="step_threads"):
        StepThreads("fast", 2)


def test_engine_tokens_do_not_depend_on_the_thread_count(gguf_path):
    """A quantized engine on 2 threads: greedy tokens with small steps timed on 1 and 2
    threads ("auto", which tries both) equal those with every step on 2 ("all")."""
    from services.engine.engine import EngineConfig
    from services.engine.llm import LLM
    from services.engine.sampling_params import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prompts = [[1, 504, 3459, 28, 2], [1, 2524, 314, 253, 1621]]
        outs = {}
        for mode in ("all", "auto"):
            llm = LLM(EngineConfig(model=str(gguf_path), quantization="auto", step_threads=mode,
                                   num_kv_blocks=64))
            tried = set()
            original = llm.engine.runner.step_threads.choose
            llm.engine.runner.step_threads.choose = lambda n: tried.add(t := original(n)) or t
            params = SamplingParams(max_tokens=3 * (FIRST_SAMPLES + 1), temperature=0.0,
                                    ignore_eos=True)
            outs[mode] = [c.token_ids for c in llm.generate(prompts, params)]
            outs[mode + "_tried"] = tried
        assert outs["auto_tried"] == {1, 2} and outs["all_tried"] == {2}
        assert outs["auto"] == outs["all"]
    finally:
        torch.set_num_threads(threads)
