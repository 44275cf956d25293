"""The unified layout (issue 15): gateway + unified workers, each one engine that prefills and
decodes (no prefill worker, no KV transfer), behind the same API. Greedy output equals
transformers', a cancelled stream frees every block, Redis records name the unified worker for
both phases, and a unified worker killed mid-stream has its streams migrated to the other one
with no gap and no repeat."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.api import gateway_pb2, gateway_pb2_grpc
from services.runtime.launcher import Stack, UpOptions
from tests.integration.conftest import (
    WORKER_ARGS, assert_all_blocks_freed, free_port, running, wait_until)
from tests.integration.test_stack import chat_request, generate
from tests.reference import CHAT_PROMPTS, NUM_TOKENS, hf_greedy_outputs

pytestmark = pytest.mark.integration
MIGRATE_TOKENS = 64  # long enough that the kill lands mid-stream


@pytest.fixture(scope="module")
def unified_stack(redis_server):
    """Two unified workers and a gateway; no prefill or decode worker at all."""
    s = Stack(UpOptions(host="127.0.0.1", port=free_port(), num_prefill=0, num_decode=0,
                        num_unified=2, redis_url=redis_server.url, worker_args=WORKER_ARGS,
                        gateway_args=["--heartbeat-s", "0.5"], ready_timeout_s=240))
    with running(s):
        yield s


async def info_of(address: str, request_id: str) -> gateway_pb2.RequestInfo:
    async with grpc.aio.insecure_channel(address) as ch:
        return await gateway_pb2_grpc.GatewayStub(ch).GetRequest(
            gateway_pb2.GetRequestRequest(request_id=request_id), timeout=10)


def test_greedy_matches_transformers_through_a_unified_stack(unified_stack):
    reference = hf_greedy_outputs()

    async def run_all():  # concurrently: prompts prefill beside other streams' decode rows
        return await asyncio.gather(*(
            generate(unified_stack.address, chat_request(p, request_id=f"uni-{i}"))
            for i, p in enumerate(CHAT_PROMPTS)))

    for prompt, expected, (tokens, text, last) in zip(CHAT_PROMPTS, reference, asyncio.run(run_all())):
        assert tokens == list(expected), prompt
        assert last.finish_reason == "length" and last.usage.completion_tokens == NUM_TOKENS
        assert text
    tokens, _, _ = asyncio.run(generate(unified_stack.address, chat_request(CHAT_PROMPTS[0])))
    assert tokens == list(reference[0])  # alone, too
    asyncio.run(assert_all_blocks_freed(unified_stack, timeout_s=20))


def test_records_name_the_unified_worker_for_both_phases(unified_stack):
    asyncio.run(generate(unified_stack.address, chat_request(CHAT_PROMPTS[1], request_id="uni-rec",
                                                             max_tokens=8)))
    info = asyncio.run(info_of(unified_stack.address, "uni-rec"))
    assert info.status == "FINISHED" and info.output_tokens == 8
    assert info.decode_worker in ("unified-0", "unified-1")
    assert info.prefill_worker == info.decode_worker
    assert 0 < info.arrival_time <= info.prefill_start_time <= info.first_token_time <= info.finish_time


def test_abort_mid_stream_frees_every_block(unified_stack):
    async def run():
        async with grpc.aio.insecure_channel(unified_stack.address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            call = stub.Generate(chat_request(CHAT_PROMPTS[2], request_id="uni-abort", max_tokens=2000))
            assert (await call.read()).token_ids
            assert (await stub.Abort(gateway_pb2.AbortRequest(request_id="uni-abort"))).found
            msgs = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                msgs.append(msg)
            assert msgs[-1].finish_reason == "abort"
            assert sum(len(m.token_ids) for m in msgs) < 2000
            await assert_all_blocks_freed(unified_stack, timeout_s=20)

            async def recorded():
                info = await stub.GetRequest(gateway_pb2.GetRequestRequest(request_id="uni-abort"))
                return info if info.status == "ABORTED" else None
            await wait_until(recorded, 10, "uni-abort recorded ABORTED")

    asyncio.run(run())


async def stream_into(address: str, request: gateway_pb2.GenerateRequest, progress: list[int]):
    async with grpc.aio.insecure_channel(address) as ch:
        last = None
        async for msg in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=300):
            progress.extend(msg.token_ids)
            last = msg
        return last


def test_killed_unified_worker_has_its_streams_migrated(unified_stack):
    """Runs last: it leaves one worker dead (this stack has no supervisor)."""
    prompts = CHAT_PROMPTS[:4]
    address = unified_stack.address

    async def run():
        reference = [[] for _ in prompts]
        await asyncio.gather(*(stream_into(address, chat_request(p, request_id=f"mref-{i}",
                                                                 max_tokens=MIGRATE_TOKENS), reference[i])
                               for i, p in enumerate(prompts)))
        progress = [[] for _ in prompts]
        calls = [asyncio.ensure_future(stream_into(address, chat_request(
            p, request_id=f"mig-{i}", max_tokens=MIGRATE_TOKENS), progress[i]))
            for i, p in enumerate(prompts)]
        await wait_until(lambda: _all_started(progress, calls), 120, "every stream's first tokens")
        victim = (await info_of(address, "mig-0")).decode_worker
        unified_stack.process(victim).kill()
        assert len(progress[0]) < MIGRATE_TOKENS, "decoding finished before the kill"
        lasts = await asyncio.gather(*calls)
        return reference, progress, lasts, victim

    reference, progress, lasts, victim = asyncio.run(run())
    for i, last in enumerate(lasts):
        assert progress[i] == reference[i], i  # no gap, no repeat: as uninterrupted
        assert len(progress[i]) == MIGRATE_TOKENS and last.finish_reason == "length"
    assert reference[0][:NUM_TOKENS] == list(hf_greedy_outputs()[0])
    info = asyncio.run(info_of(address, "mig-0"))
    assert info.status == "FINISHED" and info.decode_worker not in ("", victim)
    asyncio.run(assert_all_blocks_freed(unified_stack, timeout_s=20))


async def _all_started(progress: list[list[int]], calls: list[asyncio.Future]) -> bool:
    for call in calls:
        if call.done() and call.exception() is not None:
            raise call.exception()
    return min(len(p) for p in progress) >= 4
