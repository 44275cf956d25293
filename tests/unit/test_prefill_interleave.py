"""Prefill admission interleaves chunks: with ``long_prefill_token_threshold`` a long prompt's
chunk is capped while others wait, so a short prompt queued behind it is scheduled in the same
step (issue 10, finding 4). Assertions on what the scheduler schedules; no model, no timing."""
from __future__ import annotations

import pytest

from services.engine.block_manager import BlockManager
from services.engine.policy import create_scheduler
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.static_batch import StaticScheduler
from tests.unit.test_scheduler import EOS, fake_sample, run_to_completion

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1)  # a prefill worker's requests


def prefill_scheduler(threshold: int, budget: int = 2048) -> Scheduler:
    return create_scheduler(SchedulerConfig(64, budget, 8192, long_prefill_token_threshold=threshold),
                            BlockManager(num_blocks=1024, block_size=16))


def prompt(rid: str, length: int) -> Request:
    return Request(rid, [ord(rid[0])] * length, FIRST_TOKEN, eos_token_id=EOS,
                   hold_kv_on_finish=True)


def test_a_short_prompt_behind_an_8k_prompt_is_scheduled_in_the_first_step():
    s = prefill_scheduler(threshold=512)
    long, short = prompt("long", 8000), prompt("short", 20)
    s.add_request(long)
    s.add_request(short)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"long": 512, "short": 20}
    outputs = s.update_from_output(out, fake_sample(out))
    assert [o.request_id for o in outputs] == ["short"]  # its first token, in step one
    out = s.schedule()  # nobody waits any more: the long prompt takes the whole budget
    assert out.num_scheduled_tokens == {"long": 2048}


def test_without_a_threshold_the_short_prompt_waits_for_the_long_ones_last_chunk():
    s = prefill_scheduler(threshold=0)
    long, short = prompt("long", 8000), prompt("short", 20)
    s.add_request(long)
    s.add_request(short)
    steps = []
    while short.num_computed_tokens == 0:
        out = s.schedule()
        steps.append(dict(out.num_scheduled_tokens))
        s.update_from_output(out, fake_sample(out))
    assert steps == [{"long": 2048}] * 3 + [{"long": 1856, "short": 20}]


def test_a_running_long_prompt_yields_to_a_short_one_that_arrives_later():
    s = prefill_scheduler(threshold=512)
    long = prompt("long", 8000)
    s.add_request(long)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"long": 2048}  # alone: no cap
    s.update_from_output(out, fake_sample(out))
    s.add_request(prompt("short", 20))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"long": 512, "short": 20}


def test_two_long_prompts_and_a_short_one_share_the_first_step_and_all_finish():
    s = prefill_scheduler(threshold=512)
    reqs = [prompt("a", 3000), prompt("b", 3000), prompt("c", 10)]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 512, "b": 512, "c": 10}
    s.update_from_output(out, fake_sample(out))
    assert run_to_completion(s) == {"a": [7], "b": [7]}
    assert [len(r.output_token_ids) for r in reqs] == [1, 1, 1]
    for r in reqs:
        s.release(r.request_id)
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


@pytest.mark.parametrize("policy,cls", [("continuous", Scheduler), ("static", StaticScheduler)])
def test_the_policy_picks_the_scheduler_class(policy, cls):
    s = create_scheduler(SchedulerConfig(policy=policy), BlockManager(8, 4))
    assert type(s) is cls and isinstance(s, Scheduler)
    other = "static" if policy == "continuous" else "continuous"
    with pytest.raises(ValueError, match="^policy"):
        cls(SchedulerConfig(policy=other), BlockManager(8, 4))
