"""Which workers the gateway may use: the registry's live workers, minus those that just failed
a request, with the last good listing kept for Redis outages; one gRPC channel per endpoint."""
from __future__ import annotations

import asyncio
import logging
import random
import time

import grpc
import redis

from services.auth import InternalTls, internal_channel
from services.errors import Unavailable
from services.state.registry import TTL_HEARTBEATS, WorkerInfo, WorkerRegistry

log = logging.getLogger(__name__)

LISTING_MAX_AGE_HEARTBEATS = 0.25  # a listing kept in memory is read again after this long


class WorkerPool:
    """Live workers per role, and channels to them.

    A role's listing is read from Redis at most every ``LISTING_MAX_AGE_HEARTBEATS`` of a
    heartbeat and kept in memory between (as Dynamo's and llm-d's routers keep worker state):
    an entry changes once a heartbeat, and reading it for every request was two Redis round
    trips before each prefill started. An empty listing is read again at once (a pool starting
    up). A worker reported ``lost`` is skipped for ``TTL_HEARTBEATS`` heartbeats, by which time
    the registry has dropped it if it is dead; new workers appear with their first heartbeat,
    at most that age later. When Redis is unreachable the last listing is used, so requests in
    flight can still retry or migrate (new requests fail earlier, on their Redis record).
    """

    def __init__(self, registry: WorkerRegistry, heartbeat_s: float, rpc_timeout_s: float,
                 internal_secret: str | None = None, internal_tls: InternalTls | None = None) -> None:
        self.registry = registry
        self.internal_secret = internal_secret  # sent on every call to a worker (services.auth)
        self.internal_tls = internal_tls  # mutual TLS to the workers (None: plaintext)
        self.suspect_s = TTL_HEARTBEATS * heartbeat_s
        self.listing_max_age_s = LISTING_MAX_AGE_HEARTBEATS * heartbeat_s
        self.rpc_timeout_s = rpc_timeout_s
        self._suspects: dict[str, float] = {}  # worker id -> monotonic time it is usable again
        # role -> (monotonic time read, the last listing read from Redis)
        self._last: dict[str, tuple[float, list[WorkerInfo]]] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task] = set()

    async def live(self, role: str) -> list[WorkerInfo]:
        """Usable workers of ``role`` in random order (spreads ties). Raises Unavailable."""
        return await self.live_any((role,))

    async def live_any(self, roles: tuple[str, ...]) -> list[WorkerInfo]:
        """Usable workers of any of ``roles`` in random order (spreads ties). Raises
        Unavailable when none is registered, or Redis is unreachable before any listing."""
        listings = await asyncio.gather(*(self._listing(role) for role in roles))
        workers = [w for listing in listings for w in listing]
        now = time.monotonic()
        workers = [w for w in workers if self._suspects.get(w.worker_id, 0.0) <= now]
        if not workers:
            raise Unavailable(f"no live {' or '.join(roles)} worker is registered")
        random.shuffle(workers)
        return workers

    async def _listing(self, role: str) -> list[WorkerInfo]:
        """The registry's workers of ``role``: the listing in memory while it is younger than
        ``listing_max_age_s`` and not empty, else read now; the last listing while Redis is
        unreachable."""
        now, last = time.monotonic(), self._last.get(role)
        if last is not None and last[1] and now - last[0] < self.listing_max_age_s:
            return last[1]
        try:
            workers = await self.registry.list(role)
        except (redis.RedisError, OSError) as exc:
            if last is None:
                raise Unavailable(f"worker registry (Redis) unreachable: {exc}") from exc
            log.warning("worker registry (Redis) unreachable, using its last listing: %s", exc)
            return list(last[1])
        self._last[role] = (now, workers)
        return workers

    def lost(self, worker: WorkerInfo, why: str) -> None:
        """``worker`` failed mid-request: route around it; its channel closes once the calls
        still on it have ended (a worker that only blipped must not lose its other streams)."""
        now = time.monotonic()
        log.warning("%s worker %s at %s lost: %s", worker.role, worker.worker_id, worker.endpoint, why)
        self._suspects = {w: t for w, t in self._suspects.items() if t > now}
        self._suspects[worker.worker_id] = now + self.suspect_s
        channel = self._channels.pop(worker.endpoint, None)
        if channel is not None:
            task = asyncio.ensure_future(channel.close(grace=self.rpc_timeout_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def channel(self, endpoint: str) -> grpc.aio.Channel:
        if endpoint not in self._channels:
            self._channels[endpoint] = internal_channel(endpoint, self.internal_secret,
                                                        self.internal_tls)
        return self._channels[endpoint]

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
