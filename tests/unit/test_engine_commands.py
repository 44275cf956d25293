"""Admission commands on the engine thread: ``AddRequest`` and ``Reserve`` validate, build and
admit a request in one visit (a second visit would wait out another engine step before the
prompt is scheduled), and a refused command holds nothing."""
from __future__ import annotations

import inspect
import threading

import pytest

from services.engine import commands
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.engine_loop import EngineLoop
from services.engine.request import RequestStatus
from services.engine.sampling_params import SamplingParams
from services.kv_transfer import EngineKVHooks
from tests.unit.test_engine import weights

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
NUM_BLOCKS = 8  # 16 tokens each


@pytest.fixture
def running():
    engine = LLMEngine(EngineConfig(num_kv_blocks=NUM_BLOCKS), weights=weights())
    finished: dict[str, list[int]] = {}
    done = threading.Event()

    def on_outputs(outs):
        for o in outs:
            finished.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                done.set()

    loop = EngineLoop(engine, on_outputs)
    loop.start()
    yield engine, loop, finished, done
    loop.stop()


def test_add_request_builds_and_queues_in_one_command(running):
    engine, loop, finished, done = running
    req = loop.submit(commands.AddRequest("a", [1, 2, 3], ONE_TOKEN)).result(timeout=10)
    assert req.request_id == "a" and req.prompt_token_ids == [1, 2, 3]
    assert done.wait(timeout=60)  # queued: the engine computed it with no other command
    assert len(finished["a"]) == 1
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("command", [commands.AddRequest, commands.Reserve])
def test_refused_admission_holds_nothing(running, command):
    engine, loop, _, _ = running
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="prompt_token_ids"):
        loop.submit(command("bad", [1, vocab], ONE_TOKEN)).result(timeout=10)
    with pytest.raises(ValueError, match="prompt"):
        loop.submit(command("empty", [], ONE_TOKEN)).result(timeout=10)
    assert "bad" not in engine.scheduler.requests and "empty" not in engine.scheduler.requests
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_reserve_allocates_the_prompts_blocks_or_nothing(running):
    engine, loop, _, _ = running
    req = loop.submit(commands.Reserve("r", list(range(1, 41)), ONE_TOKEN)).result(timeout=10)
    assert req.status == RequestStatus.WAITING_FOR_KV and len(req.block_table) == 3  # 40 / 16
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS - 3
    # 6 more blocks do not fit in the 5 left: nothing is reserved
    assert loop.submit(commands.Reserve("s", list(range(1, 97)), ONE_TOKEN)).result(10) is None
    assert "s" not in engine.scheduler.requests
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS - 3
    with pytest.raises(ValueError, match="request_id"):
        loop.submit(commands.Reserve("r", [1, 2], ONE_TOKEN)).result(timeout=10)
    assert loop.submit(commands.Abort("r")).result(timeout=10)
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_the_engine_offers_every_kv_handoff_hook_with_its_signature():
    hooks = sorted(n for n, v in vars(EngineKVHooks).items() if callable(v) and not n.startswith("_"))
    assert hooks == ["finish_remote_prefill", "make_request", "prefill_locally", "release", "reserve"]
    for name in hooks:
        want, got = (inspect.signature(getattr(cls, name)) for cls in (EngineKVHooks, LLMEngine))
        assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == \
            [(p.name, p.kind, p.default) for p in want.parameters.values()], name
