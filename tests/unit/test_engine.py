"""The engine on the real default model: greedy output equals transformers token for token,
and chunked prefill, preemption and the engine thread do not change it."""
from __future__ import annotations

import functools
import threading

import pytest

from services.engine.commands import AddRequest
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.engine_loop import EngineLoop
from services.engine.loader import load_model
from services.engine.model_files import default_model_path
from services.engine.sampling_params import SamplingParams
from tests.reference import CHAT_PROMPTS, NUM_TOKENS, chat_prompt_ids, hf_greedy_outputs

GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@functools.cache
def weights():
    return load_model(default_model_path())


def make_engine(**config) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"num_kv_blocks": 256, **config}), weights=weights())


def generate_all(engine: LLMEngine, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(engine.make_request(f"r{i}", ids, params))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [chat_prompt_ids(p) for p in CHAT_PROMPTS]


def test_batched_greedy_matches_transformers(prompts):
    engine = make_engine()
    assert engine.warm_up() > 0  # leaves no trace: no request, metrics, KV or prefix entry
    assert not engine.has_work() and not engine.scheduler.requests
    assert engine.metrics.num_steps == 0 and engine.scheduler.prefix_cache_queries == 0
    assert engine.block_manager.num_free_blocks == 256 and not engine.block_manager._cache
    assert generate_all(engine, prompts) == [list(r) for r in hf_greedy_outputs()]
    assert engine.block_manager.num_free_blocks == 256


def test_chunked_prefill_gives_the_same_tokens(prompts):
    engine = make_engine(max_num_batched_tokens=16)
    assert generate_all(engine, prompts[:3]) == [list(r) for r in hf_greedy_outputs()[:3]]


def test_preemption_gives_the_same_tokens_and_frees_every_block(prompts):
    # 3 sequences of ~80 tokens need ~15 blocks of 16; 10 blocks force recompute-preemption
    engine = make_engine(num_kv_blocks=10)
    assert generate_all(engine, prompts[:3]) == [list(r) for r in hf_greedy_outputs()[:3]]
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 10


def test_prefix_cache_hits_give_the_same_tokens(prompts):
    # blocks of 8: the 24-token default system prompt is 3 full blocks
    engine = make_engine(block_size=8)
    expected = [list(r) for r in hf_greedy_outputs()]
    assert generate_all(engine, prompts) == expected  # all admitted in one step: no hits yet
    hits_first_run = engine.scheduler.prefix_cache_hits
    assert generate_all(engine, prompts) == expected  # every prompt now hits its own blocks
    m = engine.metrics
    assert m.prefix_cache_queries == 2 * sum(map(len, prompts))
    assert m.prefix_cache_hits == engine.scheduler.prefix_cache_hits
    assert m.prefix_cache_hits - hits_first_run >= sum((len(p) - 1) // 8 * 8 for p in prompts)
    assert engine.block_manager.num_free_blocks == 256
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_chunked_prefill_with_prefix_caching_gives_the_same_tokens(prompts):
    engine = make_engine(block_size=8, max_num_batched_tokens=16)
    assert generate_all(engine, prompts[:3]) == [list(r) for r in hf_greedy_outputs()[:3]]
    assert engine.metrics.prefix_cache_hits >= 2 * 24  # r1 and r2 reuse r0's system prompt


def test_static_batching_gives_the_same_tokens(prompts):
    engine = make_engine(block_size=8, scheduling_policy="static", max_num_seqs=3)
    assert generate_all(engine, prompts[:5]) == [list(r) for r in hf_greedy_outputs()[:5]]
    assert engine.metrics.prefix_cache_hits >= 2 * 24  # the second batch reuses the first's
    assert engine.block_manager.num_free_blocks == 256


def test_engine_loop_runs_on_its_own_thread(prompts):
    engine = make_engine()
    done = threading.Event()
    tokens: list[int] = []
    threads = set()

    def on_outputs(outputs):
        threads.add(threading.current_thread().name)
        for o in outputs:
            tokens.extend(o.new_token_ids)
            if o.finish_reason:
                done.set()

    loop = EngineLoop(engine, on_outputs)
    loop.start()
    try:
        req = loop.submit(AddRequest("t", prompts[0], GREEDY)).result(timeout=10)
        assert req.request_id == "t" and req.prompt_token_ids == list(prompts[0])
        assert done.wait(timeout=120)
    finally:
        loop.stop()
    assert tokens == list(hf_greedy_outputs()[0])
    assert threads == {"engine"}


@pytest.mark.parametrize("ids,field", [([], "prompt"), ([1] * 9000, "prompt"), ([1, 99999], "prompt_token_ids")])
def test_bad_requests_raise_value_error_naming_the_field(ids, field):
    engine = make_engine()
    with pytest.raises(ValueError, match=f"^{field}"):
        engine.make_request("x", ids, GREEDY)


def test_the_heartbeat_reports_a_prompt_token_s_cost_apart_from_decode_rows():
    """``load()``'s ``prefill_seconds_per_token`` is the prompt fit's (decode rows apart),
    unknown (0.0) until prompts of different lengths ran, and positive after."""
    engine = make_engine()
    assert engine.load()["prefill_seconds_per_token"] == 0.0
    for n in (16, 100, 40, 120, 8, 64):  # one at a time: prompt steps of n tokens, then rows
        generate_all(engine, [list(range(100, 100 + n))],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    reported = engine.load()["prefill_seconds_per_token"]
    assert reported > 0 and reported == engine.prompt_cost.seconds_per_prompt_token


def test_a_time_budget_follows_the_prompt_fit_once_it_knows():
    """With ``max_step_ms``, each step sets the scheduler's budget from the fit over all
    scheduled tokens (a row costing one token) until the prompt fit knows, then from the
    prompt fit: prompt tokens for a step without rows, and a row's cost in prompt tokens.
    srpt's aging takes a prompt token's seconds from the same fits."""
    engine = make_engine(max_step_ms=50)
    for n in (1, 8, 64, 256, 16):
        engine.step_cost.observe(n, 0.010 + 0.0005 * n)
    engine.step()  # nothing to run: the budget is set all the same
    assert engine.scheduler.step_token_budget == pytest.approx(80, abs=1)
    assert engine.scheduler.decode_row_tokens == 1.0
    assert engine.scheduler.seconds_per_token == pytest.approx(0.0005)  # srpt's aging
    for rows, prompt in [(rows, prompt) for rows in (1, 4, 16, 32) for prompt in (0, 48)] * 2:
        engine.prompt_cost.observe(rows, prompt, 0.010 + 0.002 * rows + 0.00025 * prompt)
    engine.step()
    assert engine.scheduler.step_token_budget == pytest.approx(160, abs=1)
    assert engine.scheduler.decode_row_tokens == pytest.approx(8.0)
    assert engine.scheduler.seconds_per_token == pytest.approx(0.00025)
    off = make_engine(max_step_ms=0)  # 0: no budget (a served worker's way to turn it off)
    off.prompt_cost = engine.prompt_cost
    off.step()
    assert off.scheduler.step_token_budget is None
