"""The gateway's front door under hostile input, and its health, on a real gRPC server and a
real Redis, with no model workers: the gateway runs in-process (its own thread and event loop)
and "workers" are registry entries whose endpoint nobody listens on. Every check here happens
before a request would reach a worker, or is about health.

The stack-level counterpart (real workers keep serving after each bad input, temperature below
epsilon is greedy) is tests/integration/test_gateway_stack_inputs.py.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api import gateway_pb2, gateway_pb2_grpc
from services.engine.model_files import default_model_path
from services.gateway.app import GatewayOptions
from services.state.redis_server import RedisServer, start_redis_server
from services.state.registry import WorkerInfo, WorkerRegistry
from tests.integration.conftest import GatewayThread, free_port

pytestmark = pytest.mark.integration

HEARTBEAT_S = 0.5
STARTUP_S = 240.0  # the model file's header alone took 23 s to parse under load
DEADLINE_S = 30.0  # generous: a loaded 2-core machine; the checks wait on conditions
GENERATE = "/tandem.v1.Gateway/Generate"


class InProcessGateway:
    """``run_gateway`` on its own thread and loop, over a private Redis it can stop/restart."""

    def __init__(self) -> None:
        self.redis: RedisServer = start_redis_server()
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._gateway = GatewayThread(GatewayOptions(
            "127.0.0.1", self.port, self.redis.url, str(default_model_path()),
            rpc_timeout_s=30.0, heartbeat_s=HEARTBEAT_S))

    def is_alive(self) -> bool:
        return self._gateway.is_alive()

    def close(self) -> None:
        self._gateway.close()
        self.redis.stop()


@pytest.fixture(scope="module")
def gw() -> Iterator[InProcessGateway]:
    g = InProcessGateway()
    try:
        asyncio.run(wait_for_health(g.address, {health_pb2.HealthCheckResponse.NOT_SERVING,
                                                health_pb2.HealthCheckResponse.SERVING},
                                    timeout_s=STARTUP_S, alive=g.is_alive))
        yield g
    finally:
        g.close()


# -- helpers -----------------------------------------------------------------------------------
async def health_status(address: str) -> int | None:
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.aio.AioRpcError:
            return None
    return resp.status


async def wait_for_health(address: str, wanted: set[int], timeout_s: float = DEADLINE_S,
                          alive=lambda: True) -> int:
    deadline = time.monotonic() + timeout_s
    while (status := await health_status(address)) not in wanted:
        assert alive(), "the gateway stopped"
        assert time.monotonic() < deadline, f"health stayed {status}, wanted {wanted}"
        await asyncio.sleep(0.1)
    return status


async def register(redis_url: str, *roles: str) -> None:
    """Fake workers: registry entries (alive for minutes) whose endpoint nobody listens on."""
    client = aioredis.Redis.from_url(redis_url)
    registry = WorkerRegistry(client, heartbeat_interval_s=100.0)
    for role in roles:
        await registry.heartbeat(WorkerInfo(f"fake-{role}", role, f"127.0.0.1:{free_port()}", 10, 10))
    await client.aclose()


async def deregister(redis_url: str, role: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    await WorkerRegistry(client).deregister(role, f"fake-{role}")
    await client.aclose()


async def generate_raw(address: str, body: bytes) -> grpc.aio.AioRpcError:
    """Send ``body`` as the Generate request's bytes; returns the error it must end with."""
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.unary_stream(GENERATE, request_serializer=None,
                               response_deserializer=gateway_pb2.GenerateResponse.FromString)(body, timeout=120)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
    return err.value


async def generate_error(address: str, request: gateway_pb2.GenerateRequest) -> grpc.aio.AioRpcError:
    return await generate_raw(address, request.SerializeToString())


def hi(**fields) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(**{"prompt": "hi", "max_tokens": 4, **fields})


# -- health ------------------------------------------------------------------------------------
def test_health_follows_workers_and_redis(gw):
    NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING

    async def run():
        assert await health_status(gw.address) == NOT_SERVING  # no worker has registered yet
        await register(gw.redis.url, "prefill")
        await register(gw.redis.url, "decode")
        await wait_for_health(gw.address, {SERVING})
        await deregister(gw.redis.url, "decode")  # the last decode worker leaves
        await wait_for_health(gw.address, {NOT_SERVING})
        await register(gw.redis.url, "decode")
        await wait_for_health(gw.address, {SERVING})

        port = gw.redis.port
        gw.redis.stop()  # Redis unreachable: not ready, though the registry said so a moment ago
        await wait_for_health(gw.address, {NOT_SERVING})
        err = await generate_error(gw.address, hi())
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in err.details()
        gw.redis = start_redis_server(port=port)  # back, empty: workers re-register
        await register(gw.redis.url, "prefill", "decode")
        await wait_for_health(gw.address, {SERVING})

    asyncio.run(run())


# -- bodies ------------------------------------------------------------------------------------
def test_invalid_utf8_is_invalid_argument_naming_the_field(gw):
    body = hi(prompt="XY").SerializeToString().replace(b"XY", b"\xc3(")
    err = asyncio.run(generate_raw(gw.address, body))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("prompt:") and "UTF-8" in err.details()
    assert "DecodeError" not in err.details()
    chat = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content="QQ")])
    err = asyncio.run(generate_raw(gw.address, chat.SerializeToString().replace(b"QQ", b"\xff\xfe")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("messages[0].content:"), err.details()


def test_malformed_body_is_invalid_argument(gw):
    err = asyncio.run(generate_raw(gw.address, b"\x1a\x50abc"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details().startswith("request:") and "DecodeError" not in err.details()


def test_oversized_body_is_invalid_argument_naming_the_limit(gw):
    err = asyncio.run(generate_error(gw.address, gateway_pb2.GenerateRequest(prompt="x" * 20_000_000)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details().startswith("request:")
    assert "4194304 bytes" in err.details() and "max_request_bytes" in err.details()


# -- options -----------------------------------------------------------------------------------
@pytest.mark.parametrize("request_,field", [
    (hi(temperature=float("inf")), "temperature"),
    (hi(top_p=float("nan")), "top_p"),
    (hi(presence_penalty=float("-inf")), "presence_penalty"),
    (hi(logprobs=True, top_logprobs=1000), "top_logprobs"),
    (hi(stop_token_ids=[50000]), "stop_token_ids[0]"),
    (hi(stop_token_ids=[2, 49152]), "stop_token_ids[1]"),
    (gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content="x")] * 257),
     "messages"),
], ids=["temperature inf", "top_p nan", "presence_penalty -inf", "top_logprobs 1000",
        "stop token beyond vocab", "stop token = vocab size", "too many messages"])
def test_bad_options_are_invalid_argument_naming_the_exact_field(gw, request_, field):
    err = asyncio.run(generate_error(gw.address, request_))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details().startswith(f"{field}:"), err.details()


# -- the event loop ----------------------------------------------------------------------------
def test_tokenizing_a_huge_prompt_does_not_stall_other_requests(gw):
    """A 3.9 MB prompt takes seconds to tokenize; small requests sent one after another while
    it is tokenized must keep being answered (they fail fast: no worker listens), so several
    finish before the big one's answer (it is too long for the context)."""
    async def run():
        await register(gw.redis.url, "prefill", "decode")
        async with grpc.aio.insecure_channel(gw.address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)

            async def drain(request):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(request, timeout=300):
                        pass
                return err.value

            big = asyncio.ensure_future(drain(gateway_pb2.GenerateRequest(prompt="hello world. " * 300_000)))
            small_done = 0
            while not big.done():
                err = await drain(hi())
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err  # answered, by routing
                small_done += 1 if not big.done() else 0
            big_err = big.result()
        assert big_err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert big_err.details().startswith("prompt:") and "context" in big_err.details()
        assert small_done >= 5, small_done

    asyncio.run(run())
