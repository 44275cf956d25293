"""Static batching (``policy="static"``) with no model: drain before admit, max-length slots
held until the batch drains, fewer requests when the pool is short, never a deadlock."""
from __future__ import annotations

import pytest

from services.engine.request import Request, RequestStatus
from services.engine.sampling_params import SamplingParams
from tests.unit.test_scheduler import (
    EOS, FakeKVModel, assert_pool_full, create_requests, create_scheduler, run_to_completion,
    shared_prefix_requests, step,
)


def request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(rid, [ord(rid[0])] * prompt_len, sp, eos_token_id=EOS)


def test_no_admission_until_the_batch_drains_and_slots_are_held_until_then():
    s = create_scheduler(block_size=4, max_num_seqs=2, policy="static")
    short, long, late = request("s", 6, 2), request("l", 6, 10), request("x", 6, 2)
    for r in (long, short, late):
        s.add_request(r)
    out, _ = step(s)
    assert [r.request_id for r in out.scheduled] == ["l", "s"]
    assert len(short.block_table) == len(long.block_table) == 4  # 16 tokens: the longest slot
    step(s)
    assert short.status == RequestStatus.FINISHED_LENGTH
    while long.status == RequestStatus.RUNNING:
        assert s.block_manager.num_used_blocks == 8  # the finished slot stays allocated
        out, _ = step(s)
        assert late not in out.scheduled
    assert_pool_full(s)  # drained: every slot freed
    out, _ = step(s)
    assert out.scheduled == [late] and len(late.block_table) == 2  # its own batch: 8 tokens


def run_static_batch(reqs: list[Request], budget: int) -> list[list[str]]:
    """Run one static batch to the end; returns the row ids of every step. Checks that each
    member got exactly its tokens, that padding rows keep their member's slot (no new block)
    and never output, and that the pool ends full."""
    s = create_scheduler(num_blocks=16, block_size=4, max_num_seqs=3,
                         max_num_batched_tokens=budget, policy="static")
    for r in reqs:
        s.add_request(r)
    model, tokens, shapes, slot_blocks = FakeKVModel(s), {}, [], {}
    while s.has_work():
        out = s.schedule()
        slot_blocks = slot_blocks or {r.request_id: len(r.block_table) for r in reqs}
        shapes.append([r.request_id for r in out.scheduled])
        for pad in (r for r in out.scheduled if r.is_padding):
            member = pad.request_id.removesuffix("/padding")
            assert member not in s.requests and len(pad.block_table) == slot_blocks[member]
        for o in s.update_from_output(out, model(out)):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    expected = {r.request_id: r.sampling_params.max_tokens for r in reqs}
    assert {k: len(v) for k, v in tokens.items()} == expected
    longest = max(r.num_prompt_tokens for r in reqs) + max(expected.values())
    assert set(slot_blocks.values()) == {-(-longest // 4)}  # a left-padded batch's shape
    assert not s.padding
    assert_pool_full(s)
    return shapes


def test_the_batch_keeps_its_shape_with_padding_rows_until_it_drains():
    shapes = run_static_batch([request("a", 10, 2), request("b", 2, 10), request("c", 3, 5)], 64)
    assert all(len(rows) == 3 for rows in shapes)  # finished rows keep computing
    assert shapes[2] == ["b", "c", "a/padding"] and shapes[-1] == ["b", "a/padding", "c/padding"]
    assert len(shapes) == 10  # b's 10 tokens: prefill + 9 decode steps


def test_a_padding_row_idles_once_its_slot_is_full():
    # budget 8 staggers the prefills; slots hold 8 + 4 tokens. b finishes at step 5, its row
    # pads position 11 at step 6 and then has no slot left while c still runs
    shapes = run_static_batch([request("a", 8, 1), request("b", 8, 4), request("c", 8, 4)], 8)
    assert shapes[:3] == [["a"], ["b"], ["b", "c"]]  # no budget left for a's padding row
    assert shapes[5:] == [["c", "a/padding", "b/padding"], ["c", "a/padding"]]


def test_slots_are_capped_at_max_model_len():
    s = create_scheduler(block_size=4, max_model_len=12, policy="static")
    r = request("r", 6, 100)
    s.add_request(r)
    step(s)
    assert len(r.block_table) == 3
    run_to_completion(s)
    assert len(r.output_token_ids) == 12 - 6


def test_a_batch_that_does_not_fit_the_pool_admits_fewer():
    s = create_scheduler(num_blocks=10, block_size=4, max_num_seqs=4, policy="static")
    reqs = [request("a", 4, 4), request("b", 4, 4), request("c", 4, 28), request("d", 4, 4)]
    for r in reqs:
        s.add_request(r)
    out, _ = step(s)
    assert [r.request_id for r in out.scheduled] == ["a", "b"]  # c would make 3 slots of 8 blocks
    run_to_completion(s)
    assert {r.request_id: len(r.output_token_ids) for r in reqs} == {"a": 4, "b": 4, "c": 28, "d": 4}
    assert_pool_full(s)


def test_a_request_whose_slot_does_not_fit_falls_back_and_never_deadlocks():
    s = create_scheduler(num_blocks=8, block_size=4, policy="static")
    held = request("held", 20, 1)
    assert s.reserve(held)  # another worker's KV transfer holds 5 of the 8 blocks
    r = request("r", 6, 14)  # a 20-token slot needs 5 blocks
    s.add_request(r)
    out, _ = step(s)
    assert out.scheduled == [r] and len(r.block_table) == 2  # only its first chunk
    for _ in range(20):
        step(s)  # grows to 3 blocks, preempts itself, comes back: waits, never crashes
    assert s.num_preemptions > 0 and s.block_manager.num_used_blocks <= 8
    s.abort("held")  # the transfer is given up: its blocks return
    run_to_completion(s)
    assert len(r.output_token_ids) == 14 and r.status == RequestStatus.FINISHED_LENGTH
    assert_pool_full(s)


@pytest.mark.parametrize("caching", [True, False])
def test_static_gives_the_same_tokens_as_continuous(caching):
    def run(policy: str, num_blocks: int) -> dict[str, list[int]]:
        s = create_scheduler(num_blocks=num_blocks, block_size=2, max_num_seqs=8,
                             max_num_batched_tokens=5, policy=policy, enable_prefix_caching=caching)
        for r in shared_prefix_requests(40, max_tokens=9):
            s.add_request(r)
        tokens = run_to_completion(s, model=FakeKVModel(s))
        assert_pool_full(s)
        if caching:
            assert s.prefix_cache_hits > 0  # later batches reuse the system prompt
        return tokens

    reference = run("continuous", 1024)
    assert run("static", 64) == reference
    assert run("static", 40) == reference  # 8 blocks per slot: 5 of the 8 slots fit
    assert run("static", 12) == reference  # batches of one
    assert run("continuous", 12) == reference


def test_abort_of_the_last_running_member_frees_the_batch():
    s = create_scheduler(max_num_seqs=2, policy="static")
    a, b = create_requests(2, max_tokens=20)
    a.sampling_params = SamplingParams(temperature=0, max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert a.is_finished() and s.block_manager.num_used_blocks > 0
    assert s.abort("r1")
    assert_pool_full(s)
