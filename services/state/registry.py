"""Worker registry in Redis: who is alive, where to reach it, and how loaded it is.

Each worker writes `worker:{role}:{id}` (a hash) every heartbeat interval with a TTL of three
intervals, and adds its id to the set `workers:{role}`. A dead worker's hash expires within
three missed heartbeats; `list()` then drops it and prunes its id from the set. The gateway
routes from `list()`; several gateways can share one registry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import redis
import redis.asyncio as aioredis

logger = logging.getLogger(__name__)

# unified: one engine prefills and decodes (no KV transfer); it serves the DecodeWorker service
Role = Literal["prefill", "decode", "unified"]
ROLES: tuple[str, ...] = ("prefill", "decode", "unified")
TTL_HEARTBEATS = 3  # a worker's entry outlives its last heartbeat by this many intervals

# KEYS[1] = workers:{role}, KEYS[2..] = worker hashes; ARGV = their ids. Removes from the set
# each id whose hash no longer exists, checked atomically so a fresh heartbeat is never undone.
_PRUNE_SCRIPT = """
local removed = 0
for i, worker_id in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then
    removed = removed + redis.call('SREM', KEYS[1], worker_id)
  end
end
return removed
"""


@dataclass
class WorkerInfo:
    worker_id: str
    role: Role
    endpoint: str                 # host:port of the worker's gRPC server
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    num_running: int = 0          # sequences in the running batch
    num_waiting: int = 0          # sequences queued for admission
    num_prefill_tokens: int = 0   # uncomputed prompt tokens of requests queued or prefilling
    block_size: int = 0           # tokens per KV block (0: not reported)
    prefill_seconds_per_token: float = 0.0  # measured step cost per token (0: not known yet)
    last_heartbeat: float = 0.0   # unix seconds, stamped by WorkerRegistry.heartbeat()

    @property
    def used_kv_blocks(self) -> int:
        return max(self.total_kv_blocks - self.free_kv_blocks, 0)


_INT_FIELDS = ("free_kv_blocks", "total_kv_blocks", "num_running", "num_waiting",
               "num_prefill_tokens", "block_size")


class WorkerRegistry:
    """Registers workers and lists the live ones, per role.

    `heartbeat_interval_s` (seconds, > 0) is how often workers heartbeat; an entry's TTL is
    `TTL_HEARTBEATS` times that.

    Raises:
        ValueError: `heartbeat_interval_s` is not positive.
    """

    def __init__(self, redis: aioredis.Redis, heartbeat_interval_s: float = 1.0) -> None:
        if heartbeat_interval_s <= 0:
            raise ValueError(
                f"heartbeat_interval_s must be > 0 seconds, got {heartbeat_interval_s}")
        self.redis = redis
        self.heartbeat_interval_s = heartbeat_interval_s
        self._prune = redis.register_script(_PRUNE_SCRIPT)

    @property
    def ttl_s(self) -> float:
        return TTL_HEARTBEATS * self.heartbeat_interval_s

    @staticmethod
    def key(role: str, worker_id: str) -> str:
        return f"worker:{role}:{worker_id}"

    @staticmethod
    def set_key(role: str) -> str:
        return f"workers:{role}"

    async def heartbeat(self, info: WorkerInfo) -> None:
        """Write `info` (with `last_heartbeat` = now), reset its TTL and add it to its role's set,
        in one transaction.

        Raises:
            ValueError: unknown role, or an empty worker_id.
            redis.RedisError / OSError: Redis is unreachable.
        """
        _check_role(info.role)
        if not info.worker_id:
            raise ValueError("worker_id must not be empty")
        mapping = dataclasses.asdict(info)
        mapping["last_heartbeat"] = repr(time.time())
        key = self.key(info.role, info.worker_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=mapping)
            pipe.pexpire(key, max(1, int(self.ttl_s * 1000)))
            pipe.sadd(self.set_key(info.role), info.worker_id)
            await pipe.execute()

    async def deregister(self, role: str, worker_id: str) -> None:
        """Remove a worker's entry and set membership now (a clean shutdown).

        Raises:
            ValueError: unknown role.
        """
        _check_role(role)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key(role, worker_id))
            pipe.srem(self.set_key(role), worker_id)
            await pipe.execute()

    async def list(self, role: str) -> list[WorkerInfo]:
        """The live workers of `role`, sorted by worker_id. Members whose entry expired are
        dropped and pruned from `workers:{role}`.

        Raises:
            ValueError: unknown role.
        """
        _check_role(role)
        worker_ids = sorted(_text(m) for m in await self.redis.smembers(self.set_key(role)))
        if not worker_ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                pipe.hgetall(self.key(role, worker_id))
            hashes = await pipe.execute()
        live: list[WorkerInfo] = []
        expired: list[str] = []
        for worker_id, raw in zip(worker_ids, hashes):
            if raw:
                live.append(_decode(raw))
            else:
                expired.append(worker_id)
        if expired:
            keys = [self.set_key(role)] + [self.key(role, w) for w in expired]
            await self._prune(keys=keys, args=expired)
        return live


class Heartbeater:
    """Calls `registry.heartbeat(get_info())` every `registry.heartbeat_interval_s` seconds in
    an asyncio task, until `stop()`.

    Never crashes its worker: if Redis is unreachable (or `get_info` raises) it logs one
    warning per outage, keeps trying every interval, and logs when heartbeats resume. A
    heartbeat that takes longer than one interval counts as failed.
    """

    def __init__(self, registry: WorkerRegistry, get_info: Callable[[], WorkerInfo]) -> None:
        self.registry = registry
        self.get_info = get_info
        self._task: asyncio.Task[None] | None = None
        self._last: WorkerInfo | None = None
        self.healthy = False  # whether the latest heartbeat reached Redis
        self._failing = False  # inside an outage (warned once already)
        self._stopping = False  # stop() called: the loop ends after the beat in progress

    def start(self) -> None:
        """Start heartbeating (the first heartbeat goes out at once). Needs a running loop.

        Raises:
            RuntimeError: already started.
        """
        if self._task is not None:
            raise RuntimeError("Heartbeater already started")
        self._stopping = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name="heartbeater")

    async def stop(self) -> None:
        """Stop heartbeating and deregister the worker; a Redis error while deregistering is
        logged, not raised (the entry then expires by itself).

        The loop also ends by a flag, not by the cancellation alone: redis-py can turn the
        CancelledError raised inside a command into a ConnectionError or TimeoutError while
        it closes the connection, and the beat catches those, so a cancelled heartbeater kept
        beating and ``stop()`` waited for it forever (a draining worker that never left the
        registry nor exited)."""
        if self._task is None:
            return
        self._stopping = True
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # stop() itself was cancelled: do not swallow that
        self._task = None
        self.healthy = False
        if self._last is None:
            return
        try:
            async with asyncio.timeout(self.registry.heartbeat_interval_s):
                await self.registry.deregister(self._last.role, self._last.worker_id)
        except (redis.RedisError, OSError, TimeoutError) as exc:
            logger.warning("could not deregister worker %s: %s", self._last.worker_id, exc)

    async def _run(self) -> None:
        interval_s = self.registry.heartbeat_interval_s
        loop = asyncio.get_running_loop()
        while not self._stopping:
            started = loop.time()
            await self._beat(interval_s)
            if not self._stopping:  # a cancel lost inside the beat (stop()'s docstring)
                await asyncio.sleep(max(0.0, interval_s - (loop.time() - started)))

    async def _beat(self, timeout_s: float) -> None:
        try:
            info = self.get_info()
            self._last = info
            async with asyncio.timeout(timeout_s):
                await self.registry.heartbeat(info)
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self._fail("heartbeat to Redis failed, will keep retrying: %s",
                       str(exc) or type(exc).__name__)
        except Exception:
            if not self._failing:
                logger.exception("heartbeat failed, will keep retrying")
            self._fail(None)
        else:
            if self._failing:
                logger.info("heartbeats to Redis resumed")
            self._failing = False
            self.healthy = True

    def _fail(self, message: str | None, *args: object) -> None:
        if not self._failing and message is not None:
            logger.warning(message, *args)
        self._failing = True
        self.healthy = False


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")


def _decode(raw: dict[bytes | str, bytes | str]) -> WorkerInfo:
    fields = {_text(k): _text(v) for k, v in raw.items()}
    return WorkerInfo(
        worker_id=fields["worker_id"], endpoint=fields["endpoint"],
        role=fields["role"],  # type: ignore[arg-type]  # written from a checked Role
        last_heartbeat=float(fields.get("last_heartbeat", 0.0)),
        prefill_seconds_per_token=float(fields.get("prefill_seconds_per_token", 0.0)),
        **{name: int(fields.get(name, 0)) for name in _INT_FIELDS})


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
