"""The server's own view of a run on Tandem: every worker's load over the run, sampled by
calling each worker's ``GetLoad`` (prefill, decode and unified workers found in the Redis
registry, ``services.state.registry``) every ``interval_s`` seconds, over the gateway's gRPC or
HTTP alike. Workers' internal ports require the
stack's internal secret: it is read as the services read it (``TANDEM_INTERNAL_SECRET`` or the
file named by ``TANDEM_INTERNAL_SECRET_FILE``; ``services.auth``).

Per worker the report gives the mean and max running batch (sequences), mean waiting
sequences and mean / max KV-cache usage (1 - free / total blocks, 0-1, vLLM's
``kv_cache_usage_perc``). ``preemptions`` and ``migrations`` are reported as ``None`` until
workers expose them (a Prometheus ``/metrics`` endpoint is planned); ``extra_counters`` is the
hook: a coroutine returning ``{worker_id: {name: value}}`` merged into each worker's summary.
"""
from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import redis
import redis.asyncio as aioredis

from services.api import worker_pb2, worker_pb2_grpc
from services.auth import SECRET_ENV, SECRET_FILE_ENV, internal_channel, read_internal_secret
from services.state.registry import ROLES, WorkerRegistry

logger = logging.getLogger(__name__)

_STUBS = {"prefill": worker_pb2_grpc.PrefillWorkerStub, "decode": worker_pb2_grpc.DecodeWorkerStub,
          "unified": worker_pb2_grpc.DecodeWorkerStub}
ExtraCounters = Callable[[], Awaitable[dict[str, dict[str, float]]]]


@dataclass
class LoadSample:
    t_s: float                 # seconds on the run's clock
    worker_id: str
    role: str
    num_running: int
    num_waiting: int
    kv_usage: float            # 0-1


@dataclass
class ServerView:
    """Samples workers' load until ``stop()``; ``summary()`` aggregates per worker.

    redis_url: the deployment's Redis. interval_s: seconds between samples (> 0).
    clock: the run's clock (seconds). Errors reaching a worker are logged once and skipped.
    """

    redis_url: str
    clock: Callable[[], float] = time.perf_counter
    interval_s: float = 0.5
    extra_counters: ExtraCounters | None = None
    samples: list[LoadSample] = field(default_factory=list)
    _task: asyncio.Task | None = None
    _warned: set[str] = field(default_factory=set)
    _secret: str | None = None

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"server_poll_s must be > 0 seconds, got {self.interval_s}")
        # the stack's secret as its processes read it (``tandem up`` passes it in the env)
        self._secret = read_internal_secret(os.environ.get(SECRET_ENV), os.environ.get(SECRET_FILE_ENV))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="server-view")

    async def stop(self) -> dict:
        """Stop sampling; returns ``summary()``."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        summary = self.summary()
        if self.extra_counters is not None:
            for worker_id, counters in (await self.extra_counters()).items():
                summary["workers"].setdefault(worker_id, {}).update(counters)
        return summary

    async def _run(self) -> None:
        client = aioredis.Redis.from_url(self.redis_url)
        channels: dict[str, grpc.aio.Channel] = {}
        try:
            registry = WorkerRegistry(client)
            while True:
                started = self.clock()
                try:
                    for role in ROLES:
                        for info in await registry.list(role):
                            await self._sample(channels, role, info.worker_id, info.endpoint)
                except (redis.RedisError, OSError) as exc:
                    self._warn_once("redis", "cannot list workers in Redis: %s", exc)
                await asyncio.sleep(max(0.0, self.interval_s - (self.clock() - started)))
        finally:
            for channel in channels.values():
                await channel.close()
            await client.aclose()

    async def _sample(self, channels: dict, role: str, worker_id: str, endpoint: str) -> None:
        if endpoint not in channels:
            channels[endpoint] = internal_channel(endpoint, self._secret)
        stub = _STUBS[role](channels[endpoint])
        try:
            load = await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=self.interval_s * 4)
        except grpc.aio.AioRpcError as exc:
            self._warn_once(worker_id, "GetLoad of %s failed: %s", worker_id, exc.code().name)
            return
        usage = 1.0 - load.free_kv_blocks / load.total_kv_blocks if load.total_kv_blocks else 0.0
        self.samples.append(LoadSample(self.clock(), worker_id, role, load.num_running,
                                       load.num_waiting, usage))

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            logger.warning(message, *args)
            self._warned.add(key)

    def summary(self) -> dict:
        """``{"interval_s", "num_samples", "workers": {worker_id: {role, mean_running_batch,
        max_running_batch, mean_waiting, mean_kv_usage, max_kv_usage, preemptions,
        migrations}}}``."""
        workers: dict[str, dict] = {}
        for worker_id in sorted({s.worker_id for s in self.samples}):
            mine = [s for s in self.samples if s.worker_id == worker_id]
            workers[worker_id] = {
                "role": mine[0].role,
                "mean_running_batch": statistics.fmean(s.num_running for s in mine),
                "max_running_batch": max(s.num_running for s in mine),
                "mean_waiting": statistics.fmean(s.num_waiting for s in mine),
                "mean_kv_usage": statistics.fmean(s.kv_usage for s in mine),
                "max_kv_usage": max(s.kv_usage for s in mine),
                "preemptions": None, "migrations": None,  # not exposed by GetLoad yet
            }
        return {"interval_s": self.interval_s, "num_samples": len(self.samples), "workers": workers}
