"""Internal ports trust no one, and leases follow progress (issue 10, items 2-4), on a real
stack: 1 prefill + 1 decode worker started with an internal secret and a 2 s lease, a gateway
with the ``fail`` KV failure policy (so a lease that ended shows as a failed request, not as a
silent recompute), fault hooks on. After each test every worker reports zero used blocks.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import grpc
import pytest
import redis.asyncio as aioredis
import torch

from kernels.kv_layout import KVCacheLayout
from services.api import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.auth import internal_channel
from services.kv_transfer import KVTransferError, create_transport
from services.kv_transfer.grants import new_token
from services.runtime.launcher import Stack, UpOptions
from services.state.registry import WorkerInfo, WorkerRegistry
from tests.integration.conftest import WORKER_ARGS, free_port, running
from tests.reference import CHAT_PROMPTS, chat_prompt_ids

pytestmark = pytest.mark.integration

SECRET = "integration-secret-0123456789"
LEASE_S = 2.0
FAIL = worker_pb2.KV_FAILURE_POLICY_FAIL


@pytest.fixture(scope="module")
def stack(redis_server) -> Iterator[Stack]:
    s = Stack(UpOptions(
        host="127.0.0.1", port=free_port(), num_prefill=1, num_decode=1,
        redis_url=redis_server.url, worker_args=[*WORKER_ARGS, "--kv-lease-s", str(LEASE_S)],
        gateway_args=["--heartbeat-s", "0.5", "--kv-failure-policy", "fail"],
        env={"TANDEM_INTERNAL_SECRET": SECRET, "TANDEM_TEST_FAULT_INJECTION": "1"},
        ready_timeout_s=180))
    with running(s):
        yield s


@pytest.fixture
def workers(stack) -> Iterator[dict[str, WorkerInfo]]:
    """The stack's workers by role; after the test, every one reports zero used blocks."""
    found = asyncio.run(_workers(stack))
    yield found
    asyncio.run(_assert_all_blocks_freed(found.values()))


async def _workers(stack: Stack) -> dict[str, WorkerInfo]:
    client = aioredis.Redis.from_url(stack.redis_url)
    try:
        return {role: (await WorkerRegistry(client).list(role))[0] for role in ("prefill", "decode")}
    finally:
        await client.aclose()


def _stub(w: WorkerInfo, channel):
    if w.role == "decode":
        return worker_pb2_grpc.DecodeWorkerStub(channel)
    return worker_pb2_grpc.PrefillWorkerStub(channel)


async def _assert_all_blocks_freed(workers, timeout_s: float = LEASE_S + 5) -> None:
    deadline = time.monotonic() + timeout_s
    for w in workers:
        async with internal_channel(w.endpoint, SECRET) as ch:
            while True:
                load = await _stub(w, ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
                if load.free_kv_blocks == load.total_kv_blocks and not load.num_running:
                    break
                assert time.monotonic() < deadline, f"{w.worker_id}: {load}"
                await asyncio.sleep(0.1)


def _decode_request(request_id: str) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=chat_prompt_ids(CHAT_PROMPTS[0]),
        sampling_params=worker_pb2.SamplingParams(max_tokens=4, temperature=0.0, top_p=1.0,
                                                  repetition_penalty=1.0),
        kv_failure_policy=FAIL)


def test_internal_calls_without_the_secret_are_unauthenticated(workers):
    async def run():
        d, p = workers["decode"], workers["prefill"]
        for w in (d, p):
            async with grpc.aio.insecure_channel(w.endpoint) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _stub(w, ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async with grpc.aio.insecure_channel(d.endpoint) as ch:
            call = worker_pb2_grpc.DecodeWorkerStub(ch).Decode(_decode_request("nosecret"), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async with internal_channel(d.endpoint, SECRET) as ch:
            load = await _stub(d, ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
            assert load.free_kv_blocks == load.total_kv_blocks  # the refused Decode reserved nothing

    asyncio.run(run())


def _chat(request_id: str) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        request_id=request_id, messages=[gateway_pb2.ChatMessage(role="user", content=CHAT_PROMPTS[1])],
        max_tokens=6, temperature=0.0, ignore_eos=True)


async def _generate(address: str, request: gateway_pb2.GenerateRequest) -> list[int]:
    async with grpc.aio.insecure_channel(address) as ch:
        return [t async for m in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=120)
                for t in m.token_ids]


def test_prompt_that_outlives_its_lease_is_computed_once(stack, workers):
    """The prefill worker holds the prompt 2.5 leases before computing it; its renewals keep
    the reservation, so the request finishes under the ``fail`` policy (an ended lease would
    fail it) with the same tokens as an undelayed run."""
    async def run():
        expected = await _generate(stack.address, _chat("lease-reference"))
        delayed = await _generate(stack.address, _chat(f"lease-renewed+queue_delay={2.5 * LEASE_S}"))
        assert delayed == expected and len(expected) == 6

    asyncio.run(run())


async def _reserve(channel, request_id: str):
    call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(_decode_request(request_id), timeout=30)
    first = await call.read()
    assert first.HasField("reservation") and len(first.reservation.write_token) >= 16
    return call, first.reservation


def _sender(reservation, secret: str | None):
    meta = json.loads(reservation.transport_metadata)
    layout = KVCacheLayout(**meta["layout"])
    n = len(reservation.block_ids) + 1
    cache = torch.ones(layout.num_layers, 2, n, layout.block_size, layout.num_kv_heads,
                       layout.head_dim, dtype=layout.torch_dtype)
    return create_transport("tcp", cache, layout, host="127.0.0.1", port=0, secret=secret)


def test_forged_kv_writes_are_refused(workers):
    async def run():
        async with internal_channel(workers["decode"].endpoint, SECRET) as ch:
            call, res = await _reserve(ch, "forged")
            ids, token = list(res.block_ids), res.write_token
            local = list(range(len(ids)))
            outsider, insider = _sender(res, None), _sender(res, SECRET)
            try:
                with pytest.raises(KVTransferError, match="secret"):
                    await asyncio.to_thread(outsider.add_remote, res.transport_metadata)
                peer = await asyncio.to_thread(insider.add_remote, res.transport_metadata)
                other = [b + 1 for b in ids]
                for dest, tok in ((ids, b""), (ids, new_token()), (other, token), (ids[:1], token)):
                    with pytest.raises(KVTransferError, match="refused the write"):
                        await asyncio.to_thread(insider.write_blocks, peer, local[:len(dest)], dest,
                                                b'{"request_id": "forged"}', 5.0, token=tok)
                note = json.dumps({"request_id": "forged", "status": "not_written",
                                   "reason": "test"}).encode()
                await asyncio.to_thread(insider.write_blocks, peer, [], [], note, 5.0, token=token)
                with pytest.raises(grpc.aio.AioRpcError) as err:  # closed by the real token
                    await call.read()
                assert err.value.code() == grpc.StatusCode.ABORTED and "test" in err.value.details()
                with pytest.raises(KVTransferError, match="already used|no write is granted"):
                    await asyncio.to_thread(insider.write_blocks, peer, local, ids, note, 5.0,
                                            token=token)

                call, res = await _reserve(ch, "late")
                with pytest.raises(grpc.aio.AioRpcError) as err:  # the lease ends (policy fail)
                    await call.read()
                assert "lease" in err.value.details()
                with pytest.raises(KVTransferError, match="refused"):
                    await asyncio.to_thread(insider.write_blocks, peer, local, list(res.block_ids),
                                            b'{"request_id": "late"}', 5.0, token=res.write_token)
            finally:
                outsider.close(), insider.close()

    asyncio.run(run())
