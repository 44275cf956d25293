"""A starting stack is reported up as soon as it is: the gateway's readiness looks again every
``NOT_READY_PERIOD_S`` while not ready (not every half heartbeat), and ``tandem up``'s
``Stack.wait_ready`` returns once every worker is registered and the gateway is SERVING,
raises TimeoutError past ``ready_timeout_s`` and RuntimeError when a child has exited."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from types import SimpleNamespace

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.gateway.health import ReadinessMonitor
from services.runtime.launcher import Stack, UpOptions
from services.ports import free_port
from services.runtime.process import Child
from services.state.redis_server import start_redis_server
from services.state.registry import WorkerInfo, WorkerRegistry
from tests.unit.test_drain import FakeHealth

SERVING = health_pb2.HealthCheckResponse.SERVING


class FakeRegistry:
    def __init__(self) -> None:
        self.redis = SimpleNamespace(ping=self._ping)
        self.unified: list[str] = []

    async def _ping(self) -> bool:
        return True

    async def list(self, role: str) -> list[str]:
        return self.unified if role == "unified" else []


def test_not_ready_gateway_looks_again_well_before_half_a_heartbeat():
    async def run():
        registry, fake_health = FakeRegistry(), FakeHealth()
        monitor = ReadinessMonitor(registry, fake_health, ["tandem.v1.Gateway"], heartbeat_s=120.0)
        await monitor.start()
        try:
            async with asyncio.timeout(10):  # half a heartbeat would be 60 s
                while monitor.reason == "not checked yet":
                    await asyncio.sleep(0.01)
                assert monitor.ready is False
                registry.unified.append("unified-0")
                while fake_health.status.get("") != SERVING:
                    await asyncio.sleep(0.01)
        finally:
            await monitor.stop()
        return fake_health.status

    assert set(asyncio.run(run()).values()) == {SERVING}


@pytest.fixture(scope="module")
def redis_server():
    server = start_redis_server()
    yield server
    server.stop()


def _stack(redis_url: str, port: int, timeout_s: float) -> Stack:
    stack = Stack(UpOptions("127.0.0.1", port, 0, 0, redis_url, num_unified=1,
                            ready_timeout_s=timeout_s))
    stack.settings = SimpleNamespace(gateway=SimpleNamespace(tls_cert_file=None))
    return stack


async def _gateway(port: int, status: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await servicer.set("", status)
    await server.start()
    return server


def test_wait_ready_returns_once_the_worker_registered_and_the_gateway_serves(redis_server):
    port = free_port("127.0.0.1")
    stack = _stack(redis_server.url, port, timeout_s=60)

    async def run():
        waiting = asyncio.create_task(asyncio.to_thread(stack.wait_ready))
        await asyncio.sleep(0.3)  # the launcher has been refused by the gateway's port
        assert not waiting.done()
        redis = aioredis.Redis.from_url(redis_server.url)
        await WorkerRegistry(redis).heartbeat(WorkerInfo("unified-0", "unified", "x:1"))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # no gateway yet
        server = await _gateway(port, SERVING)
        try:
            await asyncio.wait_for(waiting, 10)
        finally:
            await server.stop(None)
            await WorkerRegistry(redis).deregister("unified", "unified-0")
            await redis.aclose()

    asyncio.run(run())


def test_wait_ready_times_out_while_the_gateway_is_not_serving(redis_server):
    port = free_port("127.0.0.1")
    stack = _stack(redis_server.url, port, timeout_s=0.5)

    async def run():
        server = await _gateway(port, health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            with pytest.raises(TimeoutError, match="not ready within"):
                await asyncio.to_thread(stack.wait_ready)
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_wait_ready_raises_when_a_child_exited(redis_server):
    stack = _stack(redis_server.url, free_port("127.0.0.1"), timeout_s=60)
    argv = [sys.executable, "-c", "raise SystemExit(3)"]
    proc = subprocess.Popen(argv)
    proc.wait()
    stack.children.append(Child("unified-0", argv, {}, proc))
    with pytest.raises(RuntimeError, match="unified-0 exited with code 3"):
        stack.wait_ready()
