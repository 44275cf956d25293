"""A drain cancels the tasks that talk to Redis (the gateway's readiness checks, a worker's
heartbeats) wherever they are, often mid-command. Each cancel must end its task: a Redis client
that swallows the cancel, or parks the task on its connection pool, hangs the drain for good
("SIGTERM: draining" and nothing after it). redis-py 8.0 and 8.1 do (hangs within a few hundred
cancels here, stuck in ``Pipeline.reset``'s pool release or in ``read_response``); 7.4 does
not, hence the ``redis<8`` pin in pyproject.toml.

Each scenario runs on its own event loop in a daemon thread, so a hang fails the test within
its bound instead of hanging the session.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from services.gateway.health import ReadinessMonitor
from services.state.registry import Heartbeater, WorkerInfo, WorkerRegistry

CANCELS = 300  # every redis-py 8.x run here hung before 300
CHECK_S = 0.002  # heartbeat interval: Redis calls back to back, each bounded by this timeout
BOUND_S = 60.0  # the whole scenario; it takes a few seconds when no cancel is lost


class NoHealth:
    """Stands in for grpc's health servicer: the statuses do not matter here."""

    async def set(self, name: str, status: int) -> None:
        pass


def run_in_thread(scenario: Callable[[], Awaitable[bool]]) -> bool:
    """``scenario()``'s result, run by ``asyncio.run`` in a daemon thread; AssertionError when
    it does not finish within ``BOUND_S``."""
    result: list[bool] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(scenario()))
        except BaseException as exc:  # noqa: BLE001 — reported by the test thread
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive(), f"a cancelled Redis call did not end within {BOUND_S:.0f}s"
    if errors:
        raise errors[0]
    return result[0]


async def registered(redis_url: str) -> tuple[aioredis.Redis, WorkerRegistry]:
    client = aioredis.Redis.from_url(redis_url)
    registry = WorkerRegistry(client, CHECK_S)
    for role in ("prefill", "decode"):
        for i in range(3):
            await registry.heartbeat(WorkerInfo(f"{role}-{i}", role, f"127.0.0.1:{5000 + i}"))
    return client, registry


async def stop_within(stop: Awaitable[None], task: asyncio.Task | None) -> None:
    """Await ``stop`` (which cancels ``task`` and awaits it) without cancelling anything more."""
    done, _ = await asyncio.wait({asyncio.ensure_future(stop)}, timeout=10.0)
    assert done, f"stop did not return within 10s; the cancelled task: {task!r}"
    done.pop().result()


def cancels_end(redis_url: str, seed: int,
                cancel_one: Callable[[WorkerRegistry, int, float], Awaitable[None]]) -> bool:
    """Run ``cancel_one(registry, i, delay_s)`` ``CANCELS`` times (``delay_s``: a random wait
    before the stop, under 10 ms) over registered workers, in ``run_in_thread``; whether the
    Redis client still answers afterwards."""
    async def scenario() -> bool:
        client, registry = await registered(redis_url)
        rng = random.Random(seed)
        try:
            for i in range(CANCELS):
                await cancel_one(registry, i, rng.random() * 0.01)
            return await client.ping()
        finally:
            await client.aclose()

    return run_in_thread(scenario)


def test_readiness_drain_ends_the_check_it_cancels(redis_url: str) -> None:
    async def drain_one(registry: WorkerRegistry, i: int, delay_s: float) -> None:
        monitor = ReadinessMonitor(registry, NoHealth(), ["svc"], CHECK_S)
        await monitor.start()
        await asyncio.sleep(delay_s)
        await stop_within(monitor.drain(), monitor._task)
        assert monitor._task is None and monitor.ready is False

    assert cancels_end(redis_url, 0, drain_one) is True


def test_heartbeater_stop_ends_the_heartbeat_it_cancels(redis_url: str) -> None:
    async def stop_one(registry: WorkerRegistry, i: int, delay_s: float) -> None:
        beats = Heartbeater(registry, lambda: WorkerInfo(f"decode-{i}", "decode", "127.0.0.1:1"))
        beats.start()
        await asyncio.sleep(delay_s)
        await stop_within(beats.stop(), beats._task)

    assert cancels_end(redis_url, 1, stop_one) is True
