"""A decode stream's lease (issue 10, finding 3): a ``local_prefill`` request whose consumer
stops reading is released after ``kv_lease_s`` and its blocks come back; a consumer that reads
gets every token. The decode servicer runs in-process over a real engine; the test drives its
``Decode`` stream directly (not pulling the next message is what a client that does not read
looks like to the handler)."""
from __future__ import annotations

import asyncio
import time

import pytest

from services.api import worker_pb2
from services.decode.server import DecodeServicer
from services.engine.engine import EngineConfig, LLMEngine
from services.runtime.worker import WorkerOptions, WorkerRuntime

LEASE_S = 0.6
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=NUM_BLOCKS, max_num_seqs=4))


def _options(engine: LLMEngine, lease_s: float = LEASE_S) -> WorkerOptions:
    return WorkerOptions(role="decode", engine=engine.config, host="127.0.0.1",
                         advertise_host="127.0.0.1", port=0, kv_port=0, kv_transport="tcp",
                         redis_url="redis://127.0.0.1:1/0", heartbeat_s=1.0, kv_lease_s=lease_s)


def _request(rid: str, max_tokens: int) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=[1, 9690, 198, 19556, 314, 260], local_prefill=True,
        sampling_params=worker_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, top_p=1.0,
                                                   repetition_penalty=1.0))


async def _until(condition, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.02)


async def _with_servicer(engine: LLMEngine, body, lease_s: float = LEASE_S) -> None:
    runtime = WorkerRuntime(_options(engine, lease_s), engine)
    runtime.engine_loop.start()  # no heartbeat: nothing here needs the registry
    servicer = DecodeServicer(runtime)
    try:
        await body(runtime, servicer)
    finally:
        servicer.close()
        runtime.engine_loop.stop()
        await runtime.redis.aclose()


def test_an_unread_stream_is_released_and_its_blocks_come_back(engine):
    async def body(runtime: WorkerRuntime, servicer: DecodeServicer):
        started = time.monotonic()
        stream = servicer.Decode(_request("unread", max_tokens=4000), None)
        first = await stream.__anext__()  # one message taken, then the consumer stops reading
        assert first.token_ids
        assert engine.block_manager.num_free_blocks < NUM_BLOCKS  # running: it holds blocks
        await _until(lambda: engine.block_manager.num_free_blocks == NUM_BLOCKS)
        assert time.monotonic() - started >= LEASE_S  # the lease, not an early release
        assert not engine.has_work()
        rest = [m async for m in stream]  # what a late reader still gets: the end of the stream
        assert rest and rest[-1].finish_reason == "abort"
        assert sum(len(m.token_ids) for m in [first, *rest]) < 4000

    asyncio.run(_with_servicer(engine, body))


def test_a_stream_that_is_read_gets_every_token(engine):
    async def body(runtime: WorkerRuntime, servicer: DecodeServicer):
        messages = [m async for m in servicer.Decode(_request("read", max_tokens=48), None)]
        assert sum(len(m.token_ids) for m in messages) == 48
        assert messages[-1].finish_reason == "length"
        await _until(lambda: engine.block_manager.num_free_blocks == NUM_BLOCKS)

    asyncio.run(_with_servicer(engine, body))
