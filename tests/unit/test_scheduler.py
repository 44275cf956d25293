"""Scheduler behaviour with no model: a fake runner samples a fixed token for every request
whose prompt (or recompute) completes in the step."""
from __future__ import annotations

import pytest

from services.engine.block_manager import BlockManager
from services.engine.request import Request, RequestStatus
from services.engine.sampling_params import SamplingParams
from services.engine.policy import create_scheduler as scheduler_for
from services.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

EOS = 2
TOKEN = 7  # what the fake runner samples unless told otherwise


def create_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=1024, **config) -> Scheduler:
    return scheduler_for(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, **config),
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


class FakeKVModel:
    """A model whose KV cache holds token ids: each step writes the scheduled tokens into their
    slots, reads the sequence back through the block table and samples a token that depends on
    it. A wrong prefix hit, a lost block or a write into a shared or cached block fails."""

    def __init__(self, s: Scheduler) -> None:
        self.bm = s.block_manager
        self.slots: list[int | None] = [None] * (self.bm.num_blocks * self.bm.block_size)

    def slot(self, r: Request, pos: int) -> int:
        bs = self.bm.block_size
        return r.block_table[pos // bs] * bs + pos % bs

    def __call__(self, out: SchedulerOutput) -> list[int | None]:
        sampled: list[int | None] = []
        for r in out.scheduled:
            start = r.num_computed_tokens
            end = start + out.num_scheduled_tokens[r.request_id]
            for pos in range(start, end):
                block = self.bm.blocks[r.block_table[pos // self.bm.block_size]]
                assert block.ref_count == 1 and block.hash is None  # private, not cached
                self.slots[self.slot(r, pos)] = r.all_token_ids[pos]
            seen = [self.slots[self.slot(r, p)] for p in range(end)]
            assert seen == r.all_token_ids[:end]
            sampled.append(3 + (7 * sum(seen[-3:]) + end) % 40 if end == r.num_tokens else None)
        return sampled


def run_to_completion(s: Scheduler, max_steps=10_000, model=None) -> dict[str, list[int]]:
    """Step until drained; returns each request's tokens. No request is both preempted and
    scheduled in one step (no admission in a step that preempted)."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not s.has_work():
            return tokens
        out = s.schedule()
        assert not set(map(id, out.scheduled)) & set(map(id, out.preempted))
        for o in s.update_from_output(out, (model or fake_sample)(out)):
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


# -- prefix caching ----------------------------------------------------------------------------
SYSTEM = list(range(100, 112))  # a 12-token shared system prompt: 3 full blocks of 4


def assert_pool_full(s: Scheduler) -> None:
    bm = s.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_shared_system_prompt_is_computed_once():
    s = create_scheduler()
    sp = SamplingParams(temperature=0, max_tokens=3)
    a = Request("a", SYSTEM + [1, 2], sp, eos_token_id=EOS)
    b = Request("b", SYSTEM + [3, 4, 5], sp, eos_token_id=EOS)
    s.add_request(a)
    step(s)
    s.add_request(b)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}  # b computes only its own tokens
    assert b.block_table[:3] == a.block_table[:3]
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (14 + 15, 12)
    run_to_completion(s)
    assert a.output_token_ids == b.output_token_ids == [TOKEN] * 3
    assert_pool_full(s)


def test_a_fully_cached_prompt_recomputes_its_last_block_for_logits():
    s = create_scheduler()
    sp = SamplingParams(temperature=0, max_tokens=1)
    for rid in ("a", "b"):
        s.add_request(Request(rid, SYSTEM, sp, eos_token_id=EOS))
        out, outputs = step(s)
        assert [o.request_id for o in outputs] == [rid]
    assert out.num_scheduled_tokens == {"b": 4}  # 2 of 3 blocks hit, the last one is computed
    assert s.prefix_cache_hits == 8


def test_prefix_caching_off_never_hits():
    s = create_scheduler(enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=2)
    s.add_request(Request("a", SYSTEM + [1], sp, eos_token_id=EOS))
    step(s)
    s.add_request(Request("b", SYSTEM + [2], sp, eos_token_id=EOS))
    out, _ = step(s)
    assert out.num_scheduled_tokens["b"] == 13
    assert s.prefix_cache_queries == s.prefix_cache_hits == s.block_manager.num_cached_blocks == 0


def test_preempted_requests_resume_from_their_cached_blocks():
    # 3 prompts of 3 blocks growing to 5 blocks; 14 blocks: one preemption
    s = create_scheduler(num_blocks=14, block_size=4)
    reqs = create_requests(3, prompt_len=12, max_tokens=8)  # distinct prompts: hits are own blocks
    for r in reqs:
        s.add_request(r)
    tokens = run_to_completion(s, model=FakeKVModel(s))
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0
    reference = create_scheduler(num_blocks=64, enable_prefix_caching=False)
    for r in create_requests(3, prompt_len=12, max_tokens=8):
        reference.add_request(r)
    assert tokens == run_to_completion(reference, model=FakeKVModel(reference))
    assert_pool_full(s)


def test_remote_prefill_blocks_enter_the_prefix_cache():
    s = create_scheduler()
    sp = SamplingParams(temperature=0, max_tokens=4)
    remote = Request("remote", SYSTEM + [1], sp, eos_token_id=EOS)
    assert s.reserve(remote)
    s.finish_remote_prefill("remote", 9)
    local = Request("local", SYSTEM + [5, 6], sp, eos_token_id=EOS)
    s.add_request(local)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"remote": 1, "local": 2}


def test_each_block_a_decode_fills_enters_the_prefix_cache_at_the_step_that_fills_it():
    """Prompt chunks and decode rows alike: after every step the request's full blocks (its
    computed tokens // block size) are in the cache, whether the prompt's tail or decoded."""
    s = create_scheduler(max_num_batched_tokens=5)  # the 6-token prompt in chunks of 5 and 1
    (r,) = create_requests(1, prompt_len=6, max_tokens=15)
    s.add_request(r)
    bm, seen = s.block_manager, []
    while s.has_work():
        step(s)
        if not r.is_finished():
            seen.append(r.num_computed_tokens)
            assert bm.num_cached_blocks == r.num_computed_tokens // bm.block_size
    assert seen[:3] == [5, 6, 7] and len(seen) == 15 and bm.num_cached_blocks == 5  # 20 // 4


def shared_prefix_requests(n: int, max_tokens: int) -> list[Request]:
    """Prompts of 6 tokens: a 4-token system prompt, one of 3 topics, a per-request token."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [Request(f"r{i}", [1, 2, 3, 4, 20 + i % 3, 30 + i], sp, eos_token_id=EOS) for i in range(n)]


@pytest.mark.parametrize("caching", [True, False])
def test_stress_hundreds_of_preemptions_with_shared_prefixes(caching):
    s = create_scheduler(num_blocks=10, block_size=2, max_num_seqs=16, max_num_batched_tokens=32,
                         enable_prefix_caching=caching)
    for r in shared_prefix_requests(120, max_tokens=10):
        s.add_request(r)
    tokens = run_to_completion(s, model=FakeKVModel(s))
    assert s.num_preemptions >= 100
    assert (s.prefix_cache_hits > 0) == caching
    reference = create_scheduler(num_blocks=1024, max_num_seqs=64, enable_prefix_caching=False)
    for r in shared_prefix_requests(120, max_tokens=10):
        reference.add_request(r)
    assert tokens == run_to_completion(reference, model=FakeKVModel(reference))
    assert all(len(t) == 10 for t in tokens.values()) and len(tokens) == 120
    assert_pool_full(s)
    assert not s.requests and not s.has_work()


def test_a_sequence_longer_than_the_pool_finishes_instead_of_preempting_itself_forever():
    s = create_scheduler(num_blocks=4, block_size=4)  # 16 tokens in all
    (r,) = create_requests(1, prompt_len=6, max_tokens=100)
    s.add_request(r)
    tokens = run_to_completion(s)
    assert len(tokens["r0"]) == 10 and r.status == RequestStatus.FINISHED_LENGTH
    assert s.num_preemptions == 0
    assert_pool_full(s)


def test_sliding_window_frees_blocks_as_decoding_advances_and_returns_every_block():
    s = create_scheduler(num_blocks=32, block_size=4, sliding_window=8)
    (r,) = create_requests(1, prompt_len=20, max_tokens=30)
    s.add_request(r)
    used = []
    while s.has_work():
        step(s)
        used.append(s.block_manager.num_used_blocks)
    # after the prompt, the next token (position 20) sees 13..20: blocks 3 and 4 are kept; a
    # window of 8 tokens never spans more than 3 blocks of 4
    assert used[0] == 2 and max(used) == 3 and len(used) == 30
    assert s.block_manager.num_free_blocks == 32


def test_sliding_window_keeps_a_prefill_workers_blocks_for_the_transfer():
    s = create_scheduler(num_blocks=32, block_size=4, sliding_window=8)
    (r,) = create_requests(1, prompt_len=20, max_tokens=1)
    r.hold_kv_on_finish = True
    s.add_request(r)
    step(s)
    assert r.is_finished() and len(r.block_table) == 5
    assert s.block_manager.num_used_blocks == 5  # all sent to the decode worker
    s.release(r.request_id)
    assert s.block_manager.num_free_blocks == 32


def test_sliding_window_frees_a_remote_prefills_blocks_when_its_kv_lands():
    s = create_scheduler(num_blocks=32, block_size=4, sliding_window=8)
    (r,) = create_requests(1, prompt_len=20, max_tokens=5)
    assert s.reserve(r) and s.block_manager.num_used_blocks == 5
    s.finish_remote_prefill(r.request_id, TOKEN)
    assert s.block_manager.num_used_blocks == 2  # the next token sees 13..20: blocks 3, 4
    while s.has_work():
        step(s)
    assert s.block_manager.num_free_blocks == 32


def test_a_remote_prefill_skips_the_blocks_before_the_window_and_none_enters_the_cache():
    """The decode worker asks for the blocks the window still reads (3 of 5: the token after a
    20-token prompt sees positions 13..20); the 3 blocks never written must not become prefix
    cache entries, so nothing of the request is cached, and a later prompt finds no hit."""
    s = create_scheduler(num_blocks=32, block_size=4, sliding_window=8)
    (r,) = create_requests(1, prompt_len=20, max_tokens=5)
    assert s.reserve(r) and s.skipped_prompt_blocks(r) == 3
    s.finish_remote_prefill(r.request_id, TOKEN)
    assert s.block_manager.num_cached_blocks == 0
    while s.has_work():
        step(s)
    assert s.block_manager.num_cached_blocks == 0 and s.block_manager.num_free_blocks == 32
    (again,) = create_requests(1, prompt_len=20, max_tokens=1)
    again.request_id = "again"
    s.add_request(again)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"again": 20}  # computed whole: no stale hit


def test_the_skip_keeps_the_cached_prefix_and_one_block_at_least():
    s = create_scheduler(num_blocks=32, block_size=4, sliding_window=8)
    (r,) = create_requests(1, prompt_len=20, max_tokens=5)
    r.num_cached_tokens = 8  # 2 blocks pinned from the decode worker's cache
    assert s.skipped_prompt_blocks(r) == 1
    r.num_cached_tokens = 16
    assert s.skipped_prompt_blocks(r) == 0
    tiny = create_scheduler(num_blocks=32, block_size=4, sliding_window=1)
    (w,) = create_requests(1, prompt_len=8, max_tokens=5)
    assert tiny.skipped_prompt_blocks(w) == 1  # the last block is written whatever the window
    assert create_scheduler(num_blocks=32, block_size=4).skipped_prompt_blocks(w) == 0


def test_a_mixed_model_writes_the_blocks_before_the_window_for_its_global_layers_only():
    """Gemma: the global layers read every block, so none is skipped or freed; the 3 blocks
    before the sliding layers' window are partial (sent for the global layers only), and with
    them half-written none of the request's blocks enters the prefix cache."""
    s = create_scheduler(num_blocks=32, block_size=4, mixed_sliding_window=8)
    (r,) = create_requests(1, prompt_len=20, max_tokens=5)
    assert s.reserve(r) and s.skipped_prompt_blocks(r) == 0 and s.partial_prompt_blocks(r) == 3
    r.num_cached_tokens = 8  # 2 blocks pinned from the decode worker's cache: 1 partial after
    assert s.partial_prompt_blocks(r) == 1
    r.num_cached_tokens = 0
    s.finish_remote_prefill(r.request_id, TOKEN)
    assert s.block_manager.num_used_blocks == 5 and s.block_manager.num_cached_blocks == 0
    while s.has_work():
        step(s)
    assert s.block_manager.num_cached_blocks == 0 and s.block_manager.num_free_blocks == 32


@pytest.mark.parametrize("policy", ["static"])
def test_static_batching_keeps_its_slots_under_a_sliding_window(policy):
    s = create_scheduler(num_blocks=64, block_size=4, sliding_window=8, policy=policy,
                         max_model_len=40)
    for r in create_requests(2, prompt_len=20, max_tokens=12):
        s.add_request(r)
    while s.has_work():
        step(s)
    assert s.block_manager.num_free_blocks == 64
