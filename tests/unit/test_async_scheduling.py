"""Async scheduling (engine.py's ``_launch_ahead``): a decode step launched before the previous
one's tokens are read gives the same tokens, finish reasons and freed blocks as stepping one
at a time. On by default on a GPU only; forced on here so that the CPU runs the same path (the
CPU kernels are batch-invariant: tokens must be equal exactly)."""
from __future__ import annotations

import random

import pytest
import torch

from services.engine.engine import LLMEngine
from services.engine.sampling_params import SamplingParams
from tests.reference import CHAT_PROMPTS, chat_prompt_ids, hf_greedy_outputs
from tests.unit.test_engine import GREEDY, generate_all, make_engine


def counting_steps_ahead(engine: LLMEngine, measure=lambda e, out: len(out.scheduled),
                         ) -> list[int]:
    """Count the steps ``engine`` launches ahead (one entry per launch: ``measure(engine,
    out)``, by default its batch size)."""
    launched, launch_ahead = [], engine.runner.launch_ahead

    def counted(out, previous, keep, timed):
        launched.append(measure(engine, out))
        return launch_ahead(out, previous, keep, timed)

    engine.runner.launch_ahead = counted
    return launched


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]],
        arrivals: dict[int, list[int]] | None = None, aborts: dict[int, str] | None = None,
        ) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Step ``engine`` until done: requests ``arrivals[k]`` (indices) are added before step
    ``k`` (the rest at once), ``aborts[k]`` is aborted before step ``k``. Returns each request's
    tokens and finish reason."""
    arrivals = arrivals or {0: list(range(len(requests)))}
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    step = 0
    while step <= max(arrivals) or engine.has_work():
        for i in arrivals.get(step, []):
            request_id, ids, params = requests[i]
            engine.add_request(engine.make_request(request_id, ids, params))
        if aborts and step in aborts:
            engine.abort(aborts[step])
        for o in engine.step():
            assert o.request_id not in reasons, f"{o.request_id}: output after it finished"
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
        step += 1
    return tokens, reasons


def random_requests(n: int, seed: int, **params) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(17, 49000) for _ in range(rng.randrange(4, 40))],
             SamplingParams(temperature=0, max_tokens=rng.randrange(1, 24), **params))
            for i in range(n)]


def test_greedy_through_steps_ahead_matches_transformers():
    engine = make_engine(async_scheduling=True)
    ahead = counting_steps_ahead(engine)
    prompts = [chat_prompt_ids(p) for p in CHAT_PROMPTS]
    assert generate_all(engine, prompts, GREEDY) == [list(r) for r in hf_greedy_outputs()]
    assert len(ahead) >= GREEDY.max_tokens - 2 and max(ahead) == len(prompts)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("seed", [0, 1])
def test_arrivals_lengths_stop_tokens_and_aborts_as_without_it(seed):
    """Requests of random lengths arriving while steps run ahead, one aborted mid-stream, and
    stop tokens met while a step ahead is in flight (the token it computed is dropped): the
    same tokens, finish reasons and free blocks as one step at a time."""
    sync = make_engine(async_scheduling=False)
    requests = random_requests(10, seed, ignore_eos=True)
    first, _ = run(sync, requests)
    # a stop token each run meets early: the third token of every request long enough
    requests = [(rid, ids, p.model_copy(update={"stop_token_ids": (first[rid][2],)}))
                if len(first[rid]) > 4 else (rid, ids, p) for rid, ids, p in requests]
    rid, ids, p = requests[0]  # aborted at step 5, long before its end
    requests[0] = (rid, ids, p.model_copy(update={"max_tokens": 40, "stop_token_ids": ()}))
    arrivals, aborts = {0: [0, 1, 2, 3], 3: [4, 5], 7: [6, 7, 8], 9: [9]}, {5: "r0"}
    want = run(make_engine(async_scheduling=False), requests, arrivals, aborts)
    engine = make_engine(async_scheduling=True)
    ahead = counting_steps_ahead(engine)
    got = run(engine, requests, arrivals, aborts)
    assert got == want
    assert ahead, "no step ran ahead"
    assert any(r == "stop" for r in want[1].values())
    assert "r0" not in want[1] and 0 < len(want[0]["r0"]) < 40
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_work() and not engine.scheduler.requests


def test_a_full_batch_runs_ahead_while_requests_wait():
    """More requests than ``max_num_seqs``: while the batch is full and stays full no waiting
    request can start, so steps run ahead (one step at a time before: a server loaded past its
    batch lost async scheduling); the chain breaks where a request ends (by length: before the
    step; by a stop token: a step late), and the waiting start as they would. The same tokens,
    finish reasons and free blocks as one step at a time."""
    requests = random_requests(9, 4, ignore_eos=True)
    first, _ = run(make_engine(async_scheduling=False), requests)
    requests = [(rid, ids, p.model_copy(update={"stop_token_ids": (first[rid][5],)}))
                if i % 3 == 0 and len(first[rid]) > 7 else (rid, ids, p)
                for i, (rid, ids, p) in enumerate(requests)]
    want = run(make_engine(async_scheduling=False, max_num_seqs=3), requests)
    engine = make_engine(async_scheduling=True, max_num_seqs=3)
    # the queue's length at each launch ahead
    ahead = counting_steps_ahead(engine, lambda e, out: len(e.scheduler.waiting))
    assert run(engine, requests) == want
    assert any(r == "stop" for r in want[1].values())
    assert sum(1 for n in ahead if n) >= 5, ahead  # steps ahead while requests waited
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_work() and not engine.scheduler.requests


def test_seeded_sampling_with_min_tokens_runs_ahead_with_the_same_tokens():
    """Random rows sample on the device too: each row's draw and its min_tokens mask count the
    token still on its way (a draw index or mask one token off changes the tokens)."""
    def requests(stops=None):
        return [(rid, ids, SamplingParams(
            temperature=0.9, top_p=0.95, top_k=40, seed=100 + i, max_tokens=16, ignore_eos=True,
            min_tokens=6 if stops else 0, stop_token_ids=(stops[rid],) if stops else ()))
            for i, (rid, ids, _) in enumerate(random_requests(6, 3))]

    first, _ = run(make_engine(async_scheduling=False), requests())
    stops = {rid: tokens[2] for rid, tokens in first.items()}  # met early: masked until 6
    want = run(make_engine(async_scheduling=False), requests(stops))
    engine = make_engine(async_scheduling=True)
    ahead = counting_steps_ahead(engine)
    assert run(engine, requests(stops)) == want and len(ahead) > 4
    assert all(len(tokens) >= 6 for tokens in want[0].values())


def test_penalties_or_logprobs_in_the_batch_run_one_step_at_a_time():
    """Penalties and logprobs read the tokens so far: no step runs ahead, and the tokens are
    those without async scheduling."""
    for params in (SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=12,
                                  ignore_eos=True),
                   SamplingParams(temperature=0, logprobs=3, max_tokens=12, ignore_eos=True)):
        requests = [(rid, ids, params) for rid, ids, _ in random_requests(3, 7)]
        want = run(make_engine(async_scheduling=False), requests)
        engine = make_engine(async_scheduling=True)
        ahead = counting_steps_ahead(engine)
        assert run(engine, requests) == want and ahead == [], params


def test_a_reservation_waits_for_the_step_ahead():
    """A decode worker's reservation hands blocks to another process's writer (CUDA IPC),
    unordered with this process's stream; a block freed while a step ran ahead (its request
    stopped or was aborted) may still take one slot of that step's K/V. So ``reserve`` waits
    for the step in flight first."""
    engine = make_engine(async_scheduling=True)
    for rid, ids, params in random_requests(4, 5):
        engine.add_request(engine.make_request(rid, ids, params.model_copy(
            update={"max_tokens": 30, "ignore_eos": True})))
    while engine._ahead is None:
        engine.step()
    waited = []
    engine._ahead[1].wait = lambda: waited.append(True)
    engine.abort("r0")
    reservation = engine.make_request("kv-in", list(range(20, 60)), GREEDY)
    assert engine.reserve(reservation) and waited == [True]


def test_steps_ahead_through_the_graph_buffers_match_transformers():
    """The CUDA-graph runner's static buffers (run eagerly on CPU, ``capture=False``) take a step
    ahead's input tokens from the device tensor of the step before."""
    from tests.unit.test_cuda_graphs import padded_engine

    engine = padded_engine(max_num_seqs=20, async_scheduling=True)
    ahead = counting_steps_ahead(engine)
    prompts = [chat_prompt_ids(p) for p in CHAT_PROMPTS[:5]]
    assert generate_all(engine, prompts, GREEDY) == [list(r) for r in hf_greedy_outputs()[:5]]
    assert 5 in ahead and engine.block_manager.num_free_blocks == 256


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_steps_ahead_give_the_tokens_of_steps_one_at_a_time():
    """bf16 with CUDA graphs, where async scheduling is on by default: the same greedy tokens as
    with it off (8 requests: one bucket, the same rows in every step either way)."""
    from services.engine.engine import EngineConfig

    prompts = [chat_prompt_ids(p) for p in CHAT_PROMPTS]
    outs, launched = [], []
    for async_scheduling in (False, None):
        engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=512,
                                        max_num_seqs=16, async_scheduling=async_scheduling))
        launched.append(counting_steps_ahead(engine))
        outs.append(generate_all(engine, prompts, GREEDY))
        assert engine.block_manager.num_free_blocks == 512
    assert outs[0] == outs[1] and not launched[0] and len(launched[1]) >= GREEDY.max_tokens - 2



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_wait_for_a_steps_tokens_sleeps(monkeypatch):
    """The step's one host wait (``PendingStep.wait``, on ``model_runner.copy_done_event``)
    sleeps instead of spinning: with every forward made ~20 ms longer on the device
    (``torch.cuda._sleep``), the waits take wall time and almost no CPU time of the thread
    that waits. CUDA's default event fails this: its wait spins, all of it CPU time."""
    import time

    from services.engine.engine import EngineConfig
    from services.engine.model_runner import PendingStep

    engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=512,
                                    max_num_seqs=16))
    forward = engine.runner.forward

    def slow_forward(inputs):
        torch.cuda._sleep(40_000_000)  # clock cycles: ~20 ms at 2 GHz
        return forward(inputs)

    engine.runner.forward = slow_forward
    waited = {"cpu": 0.0, "wall": 0.0}
    wait = PendingStep.wait

    def timed_wait(step: PendingStep) -> None:
        c0, w0 = time.thread_time(), time.perf_counter()
        wait(step)
        waited["cpu"] += time.thread_time() - c0
        waited["wall"] += time.perf_counter() - w0

    monkeypatch.setattr(PendingStep, "wait", timed_wait)
    generate_all(engine, [chat_prompt_ids(p) for p in CHAT_PROMPTS[:4]], GREEDY)
    assert waited["wall"] > 0.1, waited  # the steps did wait on the device
    assert waited["cpu"] < 0.2 * waited["wall"], waited
    assert engine.block_manager.num_free_blocks == 512


def land_remote_prefill(prefill: LLMEngine, decode: LLMEngine, request_id: str,
                        ids: list[int], params: SamplingParams) -> None:
    """A P/D handoff in process: ``prefill`` computes the prompt and its first token, the
    decode engine reserves blocks, the K/V is copied block by block (as the TCP transport
    writes it) and the request is admitted with its first token."""
    prefill.add_request(prefill.make_request(request_id, ids, params, hold_kv=True))
    first = None
    while first is None:
        first = next((o.new_token_ids[0] for o in prefill.step()
                      if o.request_id == request_id and o.new_token_ids), None)
    request = decode.make_request(request_id, ids, params)
    assert decode.reserve(request)
    src = prefill.scheduler.requests[request_id].block_table
    dst = request.block_table
    decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, src[:len(dst)]]
    prefill.release(request_id)
    assert decode.finish_remote_prefill(request_id, first) is not None


def test_requests_admitted_from_a_remote_prefill_join_the_steps_ahead():
    """A decode worker admits a remote prefill's request while steps run ahead: it joins the
    next step ahead (its input token from the host, the others' from the device) instead of
    breaking the chain, and every request's tokens are those of stepping one at a time."""
    requests = [(rid, ids, p.model_copy(update={"max_tokens": 20 + i}))
                for i, (rid, ids, p) in enumerate(random_requests(6, 11, ignore_eos=True))]
    arrivals = {0: [0, 1], 2: [2], 3: [3], 6: [4, 5]}
    outs, sizes = [], []
    for async_scheduling in (False, True):
        prefill, decode = make_engine(), make_engine(async_scheduling=async_scheduling)
        launched = counting_steps_ahead(decode)
        tokens: dict[str, list[int]] = {}
        step, sizes = 0, []  # per step call: the size of the step it launched ahead (0: none)
        while step <= max(arrivals) or decode.has_work():
            for i in arrivals.get(step, []):
                land_remote_prefill(prefill, decode, *requests[i])
            before = len(launched)
            for o in decode.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            sizes.append(launched[-1] if len(launched) > before else 0)
            # a chain can last as long as the load: finished requests' rows go meanwhile, but
            # for those the step in flight still writes (one step at a time: at the next step)
            gone = decode.scheduler.finished_req_ids
            if decode._ahead is not None:
                gone = gone & {r.request_id for r in decode._ahead[0].scheduled}
            live = {r.request_id for r in decode.scheduler.running}
            assert set(decode.runner.input_batch.row_of) <= live | gone
            step += 1
        outs.append(tokens)
        assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks
    assert outs[0] == outs[1]
    # from the first decode step on, every call launches the next step, newcomers in it
    assert sizes[:8] == [2, 2, 3, 4, 4, 4, 6, 6], sizes
