"""Issue 26's engine-side policies with no model: srpt admission with aging (shortest first, no
starvation, its bound), time-budgeted steps (prompt tokens capped beside decode rows, at least
a block), the learned step cost, and a decode worker's reservation that pins its cached prefix
(only the rest is written; a local recompute starts after it)."""
from __future__ import annotations

import pytest

from services.engine.request import Request, RequestStatus
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.step_cost import PromptCostModel, StepCostModel
from tests.unit.test_scheduler import create_scheduler, fake_sample, step

BS = 4


def request(rid: str, prompt_len: int, arrival: float, max_tokens: int = 4, base: int = 10) -> Request:
    return Request(rid, [base + i % 50 for i in range(prompt_len)],
                   SamplingParams(temperature=0, max_tokens=max_tokens), eos_token_id=2,
                   arrival_time=arrival)


def admitted(s: Scheduler) -> list[str]:
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))
    return [r.request_id for r in out.scheduled]


def test_srpt_admits_the_shortest_first_fcfs_in_arrival_order():
    for policy, first in (("srpt", "short"), ("fcfs", "long")):
        s = create_scheduler(max_num_batched_tokens=40, queue_policy=policy)
        s.add_request(request("long", 36, arrival=100.0))
        s.add_request(request("short", 8, arrival=100.001))
        assert admitted(s)[0] == first


def test_srpt_ages_so_an_old_long_prompt_beats_new_short_ones():
    s = create_scheduler(max_num_batched_tokens=40, queue_policy="srpt",
                         queue_aging_tokens_per_s=10.0)
    s.add_request(request("long", 36, arrival=100.0))  # key 100 + 36 / 10 = 103.6
    s.add_request(request("soon", 8, arrival=102.0))  # 102.8: passes it
    s.add_request(request("late", 8, arrival=103.0))  # 103.8: after it (arrived after 103.6)
    assert admitted(s)[0] == "soon"
    order = []
    while s.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
        order += [r for r in admitted(s) if r not in order]
    assert order.index("long") < order.index("late")


def test_srpt_and_fcfs_are_the_only_queue_policies():
    with pytest.raises(ValueError, match="queue_policy"):
        create_scheduler(queue_policy="lifo")
    with pytest.raises(ValueError, match="queue_aging_tokens_per_s"):
        create_scheduler(queue_aging_tokens_per_s=0.0)


def test_a_time_budget_caps_prompt_tokens_beside_decode_rows():
    s = create_scheduler(max_num_batched_tokens=64, num_blocks=64)
    s.add_request(request("stream", 4, arrival=0.0, max_tokens=50))
    step(s)  # prefilled: a decode row from now on
    s.step_token_budget = 10
    s.add_request(request("prompt", 40, arrival=1.0, base=60))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"stream": 1, "prompt": 9}  # 10 - 1 row
    s.update_from_output(out, fake_sample(out))
    s.step_token_budget = 2  # less than a block: a block still goes, so prompts progress
    out = s.schedule()
    assert out.num_scheduled_tokens == {"stream": 1, "prompt": BS}
    s.update_from_output(out, fake_sample(out))
    s.abort("stream")
    out = s.schedule()  # no decode row: no cap
    assert out.num_scheduled_tokens == {"prompt": 40 - 9 - BS}


def test_a_time_budget_charges_each_decode_row_what_it_costs_in_prompt_tokens():
    s = create_scheduler(max_num_batched_tokens=64, num_blocks=64)
    for rid in ("s1", "s2"):
        s.add_request(request(rid, 4, arrival=0.0, max_tokens=50))
    step(s)  # two decode rows from now on
    s.step_token_budget, s.decode_row_tokens = 30, 2.5  # 30 - 2 x 2.5 = 25 prompt tokens
    s.add_request(request("prompt", 40, arrival=1.0, base=60))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"s1": 1, "s2": 1, "prompt": 25}


def test_the_step_cost_model_learns_base_and_per_token_cost():
    m = StepCostModel()
    assert m.token_budget(0.1) is None and m.seconds_per_token == 0.0
    for n in (1, 8, 64, 256, 1, 512, 16) * 3:
        m.observe(n, 0.010 + 0.0005 * n)
    base, per_token = m.fit()
    assert base == pytest.approx(0.010, rel=1e-6) and per_token == pytest.approx(0.0005, rel=1e-6)
    assert m.token_budget(0.110) == 200
    assert m.token_budget(0.005) == 1  # never below one token
    flat = StepCostModel()
    for _ in range(10):
        flat.observe(8, 0.01)  # one size only: no slope
    assert flat.fit() is None


def test_the_prompt_cost_model_fits_prompt_tokens_apart_from_decode_rows():
    """A decode worker's steps: decode rows at 2 ms and, now and then, a short prompt at
    0.5 ms a token. Fitted together, as the heartbeat did, the rows' cost leaks into the
    prompt's (0.89 ms); fitted apart, 0.5 ms."""
    steps = [(rows, prompt) for rows in (1, 4, 16, 32) for prompt in (0, 0, 0, 48)]
    joint, together = PromptCostModel(), StepCostModel()
    for rows, prompt in steps * 3:
        seconds = 0.010 + 0.002 * rows + 0.0005 * prompt
        joint.observe(rows, prompt, seconds)
        together.observe(rows + prompt, seconds)
    assert joint.seconds_per_prompt_token == pytest.approx(0.0005, rel=1e-6)
    assert together.seconds_per_token == pytest.approx(0.00089, rel=0.01)
    prefill = PromptCostModel()  # no decode rows: prompt tokens alone
    for prompt in (16, 512, 2048, 100) * 2:
        prefill.observe(0, prompt, 0.02 + 0.0001 * prompt)
    assert prefill.seconds_per_prompt_token == pytest.approx(0.0001, rel=1e-6)
    decode_only, tied = PromptCostModel(), PromptCostModel()
    for rows in (1, 8, 64, 3) * 3:
        decode_only.observe(rows, 0, 0.01 + 0.002 * rows)
        tied.observe(rows, 8 * rows, 0.01 + 0.003 * rows)  # prompts only ever grow with rows
    assert decode_only.seconds_per_prompt_token == 0.0 and tied.seconds_per_prompt_token == 0.0
    assert PromptCostModel().seconds_per_prompt_token == 0.0


def test_the_prompt_fit_budgets_a_step_by_rows_and_prompt_tokens_apart():
    """The same decode worker as above: 10 ms + 2 ms a row + 0.5 ms a prompt token. A 50 ms
    step beside 10 rows has 20 ms for prompts, 40 prompt tokens; the budget over all tokens
    alike gives them 23 (a 41.5 ms step)."""
    joint, together = PromptCostModel(), StepCostModel()
    assert joint.fit() is None and joint.token_budget(0.05) is None
    for rows, prompt in [(rows, prompt) for rows in (1, 4, 16, 32) for prompt in (0, 0, 0, 48)] * 3:
        seconds = 0.010 + 0.002 * rows + 0.0005 * prompt
        joint.observe(rows, prompt, seconds)
        together.observe(rows + prompt, seconds)
    assert joint.fit() == pytest.approx((0.010, 0.002, 0.0005), rel=1e-6)
    budget, row_tokens = joint.token_budget(0.050)
    assert row_tokens == pytest.approx(4.0) and budget - 10 * row_tokens == pytest.approx(40, abs=1)
    assert together.token_budget(0.050) - 10 == 23
    assert joint.token_budget(0.001) == (1, pytest.approx(4.0))  # never below one token


def reserve(s: Scheduler, rid: str, prompt: list[int]) -> Request:
    r = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=4), eos_token_id=2)
    assert s.reserve(r)
    return r


def test_a_reservation_pins_the_cached_prefix_and_only_the_rest_is_written():
    s = create_scheduler(num_blocks=32)
    prompt = list(range(100, 122))  # 22 tokens: 5 full blocks + 2
    first = reserve(s, "a", prompt)
    assert first.num_cached_tokens == 0 and len(first.block_table) == 6
    s.finish_remote_prefill("a", 7)  # the KV landed: its 5 full blocks are cached
    second = reserve(s, "b", prompt[:20] + [1, 2, 3, 4, 5])  # 25 tokens, 20 shared
    assert second.num_cached_tokens == 20
    assert second.block_table[:5] == first.block_table[:5]  # pinned, shared
    assert all(s.block_manager.blocks[b].ref_count == 2 for b in second.block_table[:5])
    assert len(second.block_table) == 7 and s.prefix_cache_hits == 20
    s.finish_remote_prefill("b", 7)
    s.abort("a")
    s.abort("b")
    assert s.block_manager.num_used_blocks == 0


def test_a_local_recompute_after_a_failed_transfer_starts_after_the_pinned_prefix():
    s = create_scheduler(num_blocks=32)
    prompt = list(range(100, 122))
    reserve(s, "a", prompt)
    s.finish_remote_prefill("a", 7)
    r = reserve(s, "b", prompt[:20] + [1, 2, 3, 4, 5])
    # what LLMEngine.prefill_locally does when the KV does not come
    r.status = RequestStatus.WAITING
    r.num_computed_tokens = r.num_cached_tokens
    s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens["b"] == 5  # only the uncached tail: shared blocks untouched
    assert r.block_table[:5] == s.requests["a"].block_table[:5]


def test_num_prefill_tokens_counts_queued_and_prefilling_prompt_tokens():
    s = create_scheduler(max_num_batched_tokens=16)
    s.add_request(request("a", 40, arrival=0.0))
    s.add_request(request("b", 8, arrival=0.0, base=70))
    assert s.num_prefill_tokens == 48
    step(s)  # 16 tokens computed
    assert s.num_prefill_tokens == 32
    reserve(s, "c", list(range(200, 240)))  # waiting for KV from elsewhere: not ours to compute
    assert s.num_prefill_tokens == 32


def test_a_prompt_waits_for_the_shared_prefix_another_is_computing_then_hits_it():
    s = create_scheduler(max_num_batched_tokens=64, num_blocks=64)
    doc = [30 + i for i in range(24)]  # 6 blocks
    a = Request("a", doc + [1, 2], SamplingParams(temperature=0, max_tokens=2), eos_token_id=2)
    b = Request("b", doc + [3, 4], SamplingParams(temperature=0, max_tokens=2), eos_token_id=2)
    other = request("other", 8, arrival=0.0, base=90)
    for r in (a, b, other):
        s.add_request(r)
    out = s.schedule()  # both fit the budget, but b would compute a's blocks again
    assert out.num_scheduled_tokens == {"a": 26, "other": 8}
    assert list(s.waiting) == [b]
    s.update_from_output(out, fake_sample(out))
    out = s.schedule()
    assert out.num_scheduled_tokens["b"] == 2 and b.num_cached_tokens == 24  # a's blocks
    s.update_from_output(out, fake_sample(out))


def test_a_prompt_behind_a_chunked_prefix_follows_it_block_by_block():
    s = create_scheduler(max_num_batched_tokens=12, num_blocks=64)
    doc = [30 + i for i in range(40)]  # 10 blocks
    a = Request("a", doc + [1], SamplingParams(temperature=0, max_tokens=2), eos_token_id=2)
    b = Request("b", doc + [2], SamplingParams(temperature=0, max_tokens=2), eos_token_id=2)
    s.add_request(a)
    s.add_request(b)
    while a.num_computed_tokens < a.num_prompt_tokens:
        out = s.schedule()
        assert "b" not in out.num_scheduled_tokens  # a is still computing what b needs
        s.update_from_output(out, fake_sample(out))
    while not b.output_token_ids:
        out = s.schedule()
        s.update_from_output(out, fake_sample(out))
    assert b.num_cached_tokens == 40 and s.prefix_cache_hits == 40


def test_under_srpt_a_long_prompts_chunks_yield_the_step_budget_to_a_short_prompt():
    for policy, short_first in (("srpt", True), ("fcfs", False)):
        s = create_scheduler(max_num_batched_tokens=64, num_blocks=128, queue_policy=policy)
        s.add_request(request("stream", 4, arrival=0.0, max_tokens=100))
        step(s)  # a decode row from now on
        s.step_token_budget = 9  # 8 prompt tokens a step beside the row
        s.add_request(request("long", 200, arrival=1.0, base=60))
        step(s)  # the long prompt starts: 8 of its tokens
        s.add_request(request("short", 8, arrival=1.05, base=200))  # key 1.058 < 1.192
        out = s.schedule()
        scheduled = out.num_scheduled_tokens
        assert ("short" in scheduled) is short_first, policy
        assert scheduled.get("short", scheduled.get("long")) == 8
        s.update_from_output(out, fake_sample(out))


def test_srpt_ages_by_the_measured_time_a_prompt_needs():
    for seconds_per_token, first in ((None, "long"), (0.02, "short")):
        s = create_scheduler(max_num_batched_tokens=250, queue_policy="srpt")
        s.seconds_per_token = seconds_per_token
        s.add_request(request("long", 200, arrival=100.0))  # 0.2 s at 1 ms/token, 4 s at 20 ms
        s.add_request(request("short", 8, arrival=102.0))  # 102.008 / 102.16
        assert admitted(s)[0] == first, seconds_per_token
