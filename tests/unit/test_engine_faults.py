"""The engine defends itself: bad sampling settings are refused naming the field, a request
whose step raises fails alone (blocks freed, every other request exact vs transformers), and an
engine that cannot continue says so once and refuses every later command."""
from __future__ import annotations

import threading

import pydantic
import pytest

from services.engine import commands
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.engine_loop import EngineLoop
from services.engine.outputs import EngineDeadError
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from tests.reference import CHAT_PROMPTS, NUM_TOKENS, chat_prompt_ids, hf_greedy_outputs
from tests.unit.test_engine import GREEDY, weights

VOCAB = 49152


def make_engine(**config) -> LLMEngine:
    fault_injection = config.pop("fault_injection", False)
    return LLMEngine(EngineConfig(**{"num_kv_blocks": 256, **config}), weights=weights(),
                     fault_injection=fault_injection)


def run(engine: LLMEngine) -> dict[str, list]:
    """Step until drained; every output of each request, in order."""
    outs: dict[str, list] = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [chat_prompt_ids(p) for p in CHAT_PROMPTS]


# -- validation: the poison request of issue 10 and friends -------------------------------------
def test_stop_token_ids_outside_the_vocabulary_are_refused_naming_the_field(prompts):
    engine = make_engine()
    poison = SamplingParams(temperature=0, max_tokens=8, min_tokens=1, stop_token_ids=(50000,))
    with pytest.raises(ValueError, match=r"^stop_token_ids: \[50000\] outside the vocabulary"):
        engine.make_request("p", prompts[0], poison)
    hand_built = Request("q", prompts[0], poison, eos_token_id=2)  # internal callers too
    with pytest.raises(ValueError, match="^stop_token_ids"):
        engine.add_request(hand_built)
    with pytest.raises(ValueError, match="^stop_token_ids"):
        engine.reserve(hand_built)
    negative = SamplingParams(stop_token_ids=(-1,))
    with pytest.raises(ValueError, match="^stop_token_ids"):
        engine.make_request("n", prompts[0], negative)
    assert not engine.scheduler.requests and engine.block_manager.num_free_blocks == 256


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_floats_are_refused_naming_the_field(field, value):
    with pytest.raises(pydantic.ValidationError) as info:
        SamplingParams(**{field: value})
    assert [e["loc"] for e in info.value.errors()] == [(field,)]


def test_a_temperature_below_epsilon_is_greedy(prompts):
    engine = make_engine()
    tiny = SamplingParams(temperature=1e-45, max_tokens=NUM_TOKENS, ignore_eos=True, seed=1)
    assert tiny.greedy
    engine.add_request(engine.make_request("tiny", prompts[0], tiny))
    assert tokens(run(engine)["tiny"]) == list(hf_greedy_outputs()[0])


# -- fault containment --------------------------------------------------------------------------
def test_a_request_that_breaks_the_sampler_fails_alone(prompts):
    """The poison of issue 10 with validation bypassed (a hand-built request, straight into the
    scheduler): the sampler's real IndexError fails that request only."""
    engine = make_engine()
    poison = SamplingParams(temperature=0, max_tokens=8, min_tokens=1, stop_token_ids=(50000,))
    for i, ids in enumerate(prompts[:3]):
        engine.add_request(engine.make_request(f"r{i}", ids, GREEDY))
    engine.scheduler.add_request(Request("poison", prompts[3], poison, eos_token_id=2))
    outs = run(engine)
    (failed,) = outs["poison"]
    assert failed.finish_reason == "abort" and "IndexError" in failed.error
    assert [tokens(outs[f"r{i}"]) for i in range(3)] == [list(r) for r in hf_greedy_outputs()[:3]]
    assert engine.block_manager.num_free_blocks == 256 and not engine.scheduler.requests


def test_a_fault_injected_request_fails_alone_while_eight_streams_finish_exactly(prompts):
    engine = make_engine(fault_injection=True)
    assert len(prompts) >= 8
    for i, ids in enumerate(prompts[:8]):
        engine.add_request(engine.make_request(f"r{i}", ids, GREEDY))
    engine.add_request(engine.make_request("bad+raise_in_step=3", prompts[0], GREEDY))
    outs = run(engine)
    *streamed, failed = outs["bad+raise_in_step=3"]
    assert len(tokens(streamed)) == 3 and tokens(streamed) == list(hf_greedy_outputs()[0][:3])
    assert failed.finish_reason == "abort" and "injected fault: raise_in_step" in failed.error
    assert [tokens(outs[f"r{i}"]) for i in range(8)] == [list(r) for r in hf_greedy_outputs()[:8]]
    assert all(outs[f"r{i}"][-1].finish_reason == "length" for i in range(8))
    assert engine.block_manager.num_free_blocks == 256 and not engine.scheduler.requests
    assert engine.has_work() is False


def test_a_step_where_every_request_fails_alone_kills_the_engine(prompts):
    engine = make_engine(fault_injection=True)
    for i in range(2):  # a first token of its own: no shared prefix for one to wait on
        engine.add_request(engine.make_request(f"r{i}+raise_in_step", [100 + i, *prompts[i]], GREEDY))
    with pytest.raises(EngineDeadError, match="every request"):
        engine.step()


def test_a_fault_outside_the_model_kills_the_engine_loop_once(prompts):
    engine = make_engine(fault_injection=True)
    died: list[BaseException] = []
    dead = threading.Event()
    outputs: list = []

    def on_fatal(exc: BaseException) -> None:
        died.append(exc)
        dead.set()

    loop = EngineLoop(engine, outputs.extend, on_fatal)
    loop.start()
    try:
        loop.submit(commands.AddRequest("c+crash_engine=2", prompts[0], GREEDY)).result(10)
        assert dead.wait(timeout=120)
        assert len(died) == 1 and "injected fault: crash_engine" in str(died[0])
        assert not loop.is_alive()
        with pytest.raises(EngineDeadError, match="crash_engine"):
            loop.submit(commands.Abort("c+crash_engine=2")).result(10)
    finally:
        loop.stop()
    assert [t for o in outputs for t in o.new_token_ids] == list(hf_greedy_outputs()[0][:2])
