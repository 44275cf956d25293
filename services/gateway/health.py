"""Gateway health that tells the truth: SERVING only while Redis answers and the worker
registry lists at least one live prefill and one live decode worker, or one live unified worker
(it prefills and decodes alone).

Checked every half heartbeat (every ``NOT_READY_PERIOD_S`` while not ready: a starting stack
is SERVING as soon as its workers have registered), so ``grpc.health.v1`` follows a change
(Redis refusing connections, the last worker of a role leaving the registry, recovery) within
one heartbeat interval; a Redis that hangs is noticed when a check times out, after one more
heartbeat (a shorter bound made health flap on a loaded machine). Readiness probes,
``tandem up`` and load balancers read it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import redis
from grpc_health.v1 import health_pb2

from services.state.registry import WorkerRegistry

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REQUIRED_ROLES = ("prefill", "decode")  # or else UNIFIED_ROLE alone
UNIFIED_ROLE = "unified"
NOT_READY_PERIOD_S = 0.1  # while not ready (a stack starting), look this often: SERVING sooner


class ReadinessMonitor:
    """Sets ``health_servicer``'s status of ``""`` and each of ``service_names`` from
    ``check()`` every ``heartbeat_s / 2`` seconds (at most ``NOT_READY_PERIOD_S`` while not
    ready), starting NOT_SERVING."""

    def __init__(self, registry: WorkerRegistry, health_servicer, service_names: Iterable[str],
                 heartbeat_s: float) -> None:
        self.registry = registry
        self.health = health_servicer
        self.names = ["", *service_names]
        self.period_s = heartbeat_s / 2
        self.timeout_s = heartbeat_s
        self.ready: bool | None = None
        self.reason = "not checked yet"
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def check(self) -> tuple[bool, str]:
        """(ready, why not) from one look at Redis and the registry, within ``timeout_s``."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.registry.redis.ping()
                if await self.registry.list(UNIFIED_ROLE):
                    return True, ""
                for role in REQUIRED_ROLES:
                    if not await self.registry.list(role):
                        return False, f"no live {role} worker (nor a unified one) is registered"
        except (redis.RedisError, OSError, TimeoutError) as exc:
            return False, f"Redis unreachable: {str(exc) or type(exc).__name__}"
        return True, ""

    async def update(self) -> bool:
        """Check once and publish the result; returns whether the gateway is ready."""
        ready, reason = await self.check()
        if ready != self.ready:
            status = SERVING if ready else NOT_SERVING
            for name in self.names:
                await self.health.set(name, status)
            if ready:
                log.info("gateway ready: Redis answers and workers are live")
            else:
                log.warning("gateway not ready: %s", reason)
        self.ready, self.reason = ready, reason
        return ready

    async def start(self) -> None:
        """Publish NOT_SERVING until the first check passes, then follow the checks."""
        for name in self.names:
            await self.health.set(name, NOT_SERVING)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="readiness")

    async def drain(self) -> None:
        """The gateway is stopping: stop checking and report NOT_SERVING (``/ready`` 503,
        reason "draining") for good."""
        await self.stop()
        self.ready, self.reason = False, "draining: the gateway is shutting down"
        for name in self.names:
            await self.health.set(name, NOT_SERVING)
        log.info("gateway not ready: draining")

    async def stop(self) -> None:
        """Stop checking. Bounded: on Python 3.11 a cancellation that lands as the check's own
        ``asyncio.timeout`` expires can be swallowed (the check returns "Redis unreachable"), so
        the loop also ends on ``_stopping`` and the wait is capped."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=self.timeout_s + self.period_s)
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            started = loop.time()
            try:
                await self.update()
            except Exception:  # noqa: BLE001 — health must keep being checked
                log.exception("readiness check failed")
            period_s = self.period_s if self.ready else min(self.period_s, NOT_READY_PERIOD_S)
            await asyncio.sleep(max(0.0, period_s - (loop.time() - started)))
