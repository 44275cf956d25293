"""Scheduler behaviour with no model: a fake runner samples a fixed token for every request
whose prompt (or recompute) completes in the step."""
from __future__ import annotations

from services.engine.block_manager import BlockManager
from services.engine.request import Request, RequestStatus
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

EOS = 2
TOKEN = 7  # what the fake runner samples unless told otherwise


def create_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=1024) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len),
                     BlockManager(num_blocks, block_size))


def create_requests(n, prompt_len=6, max_tokens=4, **params) -> list[Request]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, **params)
    return [Request(f"r{i}", [10 + i] * prompt_len, sp, eos_token_id=EOS) for i in range(n)]


def fake_sample(out: SchedulerOutput, token: int = TOKEN) -> list[int | None]:
    return [token if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens
            else None for r in out.scheduled]


def step(s: Scheduler, token: int = TOKEN):
    out = s.schedule()
    return out, s.update_from_output(out, fake_sample(out, token))


def run_to_completion(s: Scheduler, max_steps=10_000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not s.has_work():
            return tokens
        for o in step(s)[1]:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("scheduler did not drain")


def test_finished_requests_are_evicted_and_waiting_ones_admitted_next_step():
    s = create_scheduler(max_num_seqs=2)
    reqs = create_requests(3, max_tokens=1)
    for r in reqs:
        s.add_request(r)
    out, outputs = step(s)
    assert [r.request_id for r in out.scheduled] == ["r0", "r1"]  # r2 waits: max_num_seqs
    assert {o.request_id: o.finish_reason for o in outputs} == {"r0": "length", "r1": "length"}
    assert s.running == [] and s.block_manager.num_free_blocks == 64  # evicted, blocks freed
    out, _ = step(s)
    assert [r.request_id for r in out.scheduled] == ["r2"]
    assert not s.has_work() and s.block_manager.num_free_blocks == 64


def test_chunked_prefill_splits_a_prompt_over_the_token_budget():
    s = create_scheduler(max_num_batched_tokens=16)
    (r,) = create_requests(1, prompt_len=50, max_tokens=2)
    s.add_request(r)
    chunks = []
    while r.num_computed_tokens < 50:
        out, outputs = step(s)
        chunks.append(out.num_scheduled_tokens["r0"])
        if r.num_computed_tokens < 50:
            assert outputs == []  # no token sampled from a partial prompt
    assert chunks == [16, 16, 16, 2]
    assert r.output_token_ids == [TOKEN]


def test_running_decodes_are_scheduled_before_new_prefills():
    s = create_scheduler(max_num_batched_tokens=10)
    a, b = create_requests(2, prompt_len=8, max_tokens=5)
    s.add_request(a)
    step(s)  # a prefilled (8 tokens)
    s.add_request(b)
    out, _ = step(s)
    assert out.scheduled[0] is a and out.num_scheduled_tokens["r0"] == 1
    assert out.num_scheduled_tokens["r1"] == 8  # the whole prompt fits in the 9 left


def test_preemption_recomputes_newest_and_never_leaks_blocks():
    # 12 blocks of 4 tokens; 6 requests of 8-token prompts growing to 16 tokens cannot all fit
    s = create_scheduler(num_blocks=12, block_size=4, max_num_seqs=6)
    reqs = create_requests(6, prompt_len=8, max_tokens=8)
    for r in reqs:
        s.add_request(r)
    tokens = run_to_completion(s)
    assert s.num_preemptions > 0
    assert all(len(tokens[r.request_id]) == 8 for r in reqs)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert s.block_manager.num_free_blocks == 12
    assert not s.requests


def test_stress_hundreds_of_preemptions_end_with_a_full_pool():
    s = create_scheduler(num_blocks=10, block_size=2, max_num_seqs=16, max_num_batched_tokens=32)
    reqs = create_requests(60, prompt_len=3, max_tokens=16)
    for r in reqs:
        s.add_request(r)
    tokens = run_to_completion(s)
    assert s.num_preemptions >= 100
    assert sorted(tokens) == sorted(r.request_id for r in reqs)
    assert all(len(t) == 16 for t in tokens.values())
    assert s.block_manager.num_free_blocks == 10


def test_stop_conditions():
    s = create_scheduler()
    sp = lambda **kw: SamplingParams(temperature=0, **kw)  # noqa: E731
    reqs = {
        "eos": Request("eos", [5] * 4, sp(max_tokens=10), eos_token_id=EOS),
        "ignore": Request("ignore", [5] * 4, sp(max_tokens=3, ignore_eos=True), eos_token_id=EOS),
        "stop": Request("stop", [5] * 4, sp(max_tokens=10, stop_token_ids=(9,)), eos_token_id=EOS),
        "len": Request("len", [5] * 4, sp(max_tokens=2), eos_token_id=EOS),
    }
    for r in reqs.values():
        s.add_request(r)
    reasons = {}
    for tokens in ({"eos": EOS, "ignore": EOS, "stop": 8, "len": 8},
                   {"ignore": 9, "stop": 9, "len": EOS - 1},
                   {"ignore": EOS}):
        out = s.schedule()
        assert {r.request_id for r in out.scheduled} == set(tokens)
        for o in s.update_from_output(out, [tokens[r.request_id] for r in out.scheduled]):
            reasons[o.request_id] = o.finish_reason
    assert reasons == {"eos": "stop", "stop": "stop", "len": "length", "ignore": "length"}
    assert reqs["ignore"].output_token_ids == [EOS, 9, EOS]
    assert reqs["stop"].output_token_ids == [8, 9]
    assert not s.has_work() and s.block_manager.num_free_blocks == 64


def test_abort_frees_blocks_in_every_state():
    s = create_scheduler(max_num_seqs=1)
    running, waiting = create_requests(2, max_tokens=50)
    s.add_request(running)
    s.add_request(waiting)
    step(s)
    assert running.status == RequestStatus.RUNNING and waiting.status == RequestStatus.WAITING
    assert s.abort("r1") and s.abort("r0")
    assert not s.abort("r0")  # already gone
    assert s.block_manager.num_free_blocks == 64 and not s.has_work()
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED


def test_decode_role_reservation_and_remote_prefill():
    s = create_scheduler(num_blocks=8, block_size=4)
    r, short = create_requests(2, prompt_len=10, max_tokens=3)
    assert s.reserve(r)
    assert len(r.block_table) == 3 and r.status == RequestStatus.WAITING_FOR_KV
    assert not s.has_work()  # nothing to compute until the KV arrives
    assert s.num_waiting == 1
    out = s.finish_remote_prefill("r0", 42)
    assert out.new_token_ids == [42] and out.finish_reason is None
    assert r.num_computed_tokens == 10
    sched, _ = step(s)
    assert sched.num_scheduled_tokens == {"r0": 1}  # only the first token's KV is computed
    # a first token that is EOS finishes at once and frees the reservation
    assert s.reserve(short)
    assert s.finish_remote_prefill("r1", EOS).finish_reason == "stop"
    assert short.block_table == [] and "r1" not in s.requests


def test_reservation_refused_when_blocks_run_out():
    s = create_scheduler(num_blocks=2, block_size=4)
    (r,) = create_requests(1, prompt_len=9)
    assert not s.reserve(r)
    assert s.block_manager.num_free_blocks == 2


def test_hold_kv_keeps_blocks_until_released():
    s = create_scheduler()
    (r,) = create_requests(1, prompt_len=9, max_tokens=1)
    r.hold_kv_on_finish = True
    s.add_request(r)
    _, outputs = step(s)
    assert outputs[0].finish_reason == "length"
    assert len(r.block_table) == 3 and s.block_manager.num_used_blocks == 3
    s.release("r0")
    assert s.block_manager.num_free_blocks == 64
