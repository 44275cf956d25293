"""The load loop of ``bench serve``: warm-up, then requests sent on an arrival schedule under a
concurrency cap, every loop bounded in count (``len(requests)``) and time (``time_limit_s``
for sending, ``request_timeout_s`` per request). ``run_load`` runs it in one process or, with
``client_processes``, shared out among several started together (one Python client process
relays about as many tokens/s as one gateway process: too few for a GPU's).
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import multiprocessing
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from loadtest.arrivals import ArrivalSchedule
from loadtest.clients import GrpcClient, OpenAIClient, parse_target
from loadtest.datasets import SampleRequest
from loadtest.metrics import RequestRecord
from loadtest.server_view import ServerView


@dataclass(frozen=True)
class RunConfig:
    """One run's load shape and target (times in seconds).

    target: ``grpc://HOST:PORT`` or ``http(s)://HOST:PORT/v1``.
    max_concurrency: requests in flight at most (None: no cap).
    num_warmups: requests sent (and awaited) before the run, excluded from every figure.
    time_limit_s: no request is sent after this many seconds; unsent ones are counted.
    request_timeout_s: a request still running after this fails with "timeout".
    redis_url: Tandem's Redis, to sample the workers' load (its gateway over gRPC or HTTP;
        "" = off).
    client_processes: processes sending the requests (``run_load``): request i goes from
        process i mod N at its scheduled time, each under an equal share of the cap, each with
        its own connections (so a target of several gateways on one port sees several).
    grpc_channels: gRPC connections of each process (``GrpcClient``); HTTP opens one per
        request in flight.
    """

    target: str
    schedule: ArrivalSchedule
    max_concurrency: int | None = None
    num_warmups: int = 1
    time_limit_s: float = 600.0
    request_timeout_s: float = 300.0
    endpoint: str = "chat"
    model: str = ""
    api_key: str = ""
    redis_url: str = ""
    server_poll_s: float = 0.5
    progress: bool = True
    client_processes: int = 1
    grpc_channels: int = 1

    def __post_init__(self) -> None:
        parse_target(self.target)
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.client_processes < 1 or (self.max_concurrency or math.inf) < self.client_processes:
            raise ValueError(f"client_processes must be >= 1 and at most max_concurrency, got "
                             f"{self.client_processes}")
        if self.grpc_channels < 1:
            raise ValueError(f"grpc_channels must be >= 1, got {self.grpc_channels}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")
        for name in ("time_limit_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")


@dataclass
class RunOutcome:
    records: list[RequestRecord]  # the sent requests, in dataset order
    duration_s: float             # first send -> last finish
    not_sent: int                 # requests the time limit kept from being sent
    server_view: dict | None      # ServerView.summary() when sampled
    model: str                    # the model named in requests ("" for gRPC: the served one)


def make_client(cfg: RunConfig) -> GrpcClient | OpenAIClient:
    kind, address = parse_target(cfg.target)
    if kind == "grpc":
        return GrpcClient(address, timeout_s=cfg.request_timeout_s, channels=cfg.grpc_channels)
    return OpenAIClient(address, endpoint=cfg.endpoint, model=cfg.model, api_key=cfg.api_key,
                        timeout_s=cfg.request_timeout_s)


async def _send(client, req: SampleRequest, record: RequestRecord, clock, timeout_s: float) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            await client.send(req, record, clock)
    except TimeoutError:
        record.success, record.error, record.finish_s = False, f"timeout after {timeout_s:g} s", clock()
    except Exception as exc:  # noqa: BLE001  one odd response must not end a long run
        record.success, record.error, record.finish_s = False, f"{type(exc).__name__}: {exc}", clock()


async def _warm_up(client, cfg: RunConfig, requests: list[SampleRequest]) -> None:
    clock = time.perf_counter
    warm = [RequestRecord(i, r.kind, f"warmup-{uuid.uuid4().hex[:8]}-{i}")
            for i, r in enumerate(requests[:cfg.num_warmups])]
    await asyncio.gather(*(_send(client, r, rec, clock, cfg.request_timeout_s)
                           for r, rec in zip(requests, warm)))


@dataclass(frozen=True)
class Shard:
    """One client process's part of a ``run_load``: its requests' places in the dataset, their
    scheduled times (the whole run's schedule), and the barrier every process waits at after
    its warm-up, so that all start their clocks together."""

    indices: list[int]
    times: list[float]
    barrier: Any  # a multiprocessing Manager's Barrier


def run_load(cfg: RunConfig, requests: list[SampleRequest]) -> RunOutcome:
    """``run_benchmark`` in this process, or shared out among ``cfg.client_processes`` spawned
    ones (``RunConfig``); their records merged in dataset order, the duration the longest
    process's, the server view the first's. Raises as ``run_benchmark`` (and ValueError when
    there are fewer requests than processes)."""
    n = cfg.client_processes
    if n == 1:
        return asyncio.run(run_benchmark(cfg, requests))
    if len(requests) < n:
        raise ValueError(f"num_prompts ({len(requests)}) must be at least client_processes ({n})")
    times = cfg.schedule.times(len(requests))
    context = multiprocessing.get_context("spawn")  # NOTE: grpc and tokenizers do not fork
    with context.Manager() as manager, ProcessPoolExecutor(n, mp_context=context) as pool:
        barrier = manager.Barrier(n)
        cap = cfg.max_concurrency
        jobs = []
        for k in range(n):
            indices = list(range(k, len(requests), n))
            part = dataclasses.replace(
                cfg, client_processes=1, redis_url=cfg.redis_url if k == 0 else "",
                max_concurrency=None if cap is None else cap // n + (k < cap % n),
                progress=cfg.progress and k == 0)
            jobs.append(pool.submit(_run_shard, part, [requests[i] for i in indices],
                                    Shard(indices, [float(times[i]) for i in indices], barrier)))
        outcomes = [job.result() for job in jobs]
    return RunOutcome(sorted((r for o in outcomes for r in o.records), key=lambda r: r.index),
                      max(o.duration_s for o in outcomes), sum(o.not_sent for o in outcomes),
                      outcomes[0].server_view, outcomes[0].model)


def _run_shard(cfg: RunConfig, requests: list[SampleRequest], shard: Shard) -> RunOutcome:
    try:
        return asyncio.run(run_benchmark(cfg, requests, shard))
    except BaseException:
        shard.barrier.abort()  # the others stop waiting for this one
        raise


async def run_benchmark(cfg: RunConfig, requests: list[SampleRequest],
                        shard: Shard | None = None) -> RunOutcome:
    """Run ``requests`` against ``cfg.target`` (see the module doc); failures are recorded,
    not raised. ``shard``: this process's part of a ``run_load``. Raises ``ValueError`` on an
    empty list, ``ConnectionError`` when an HTTP target does not list its models (and no model
    was given), ``threading.BrokenBarrierError`` when another process of the run failed."""
    if not requests:
        raise ValueError("num_prompts must be > 0")
    client = make_client(cfg)
    try:
        model = await client.resolve_model() if isinstance(client, OpenAIClient) else ""
        await _warm_up(client, cfg, requests)
        if shard is not None:
            await asyncio.to_thread(shard.barrier.wait, cfg.request_timeout_s)
        return await _timed_run(client, cfg, requests, model, shard)
    finally:
        await client.close()


async def _timed_run(client, cfg: RunConfig, requests: list[SampleRequest], model: str,
                     shard: Shard | None = None) -> RunOutcome:
    times = shard.times if shard else cfg.schedule.times(len(requests))
    indices = shard.indices if shard else range(len(requests))
    tag = uuid.uuid4().hex[:8]
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else nullcontext()
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    view = None
    if cfg.redis_url:
        view = ServerView(cfg.redis_url, clock=clock, interval_s=cfg.server_poll_s)
        view.start()
    bar = tqdm(total=len(requests), disable=not cfg.progress, unit="req", desc="bench serve")

    skipped: set[int] = set()  # held by the concurrency cap past the time limit: never sent

    async def one(req: SampleRequest, record: RequestRecord) -> None:
        async with sem:
            if clock() > cfg.time_limit_s:
                skipped.add(record.index)
            else:
                await _send(client, req, record, clock, cfg.request_timeout_s)
        bar.update(1)

    records, tasks = [], []
    for i, req, at in zip(indices, requests, times):
        if at > cfg.time_limit_s or clock() > cfg.time_limit_s:
            break
        await asyncio.sleep(max(0.0, at - clock()))
        record = RequestRecord(i, req.kind, f"bench-{tag}-{i}", scheduled_s=float(at))
        records.append(record)
        tasks.append(asyncio.create_task(one(req, record)))
    await asyncio.gather(*tasks)
    duration = max(clock(), 1e-9)
    bar.close()
    server = await view.stop() if view is not None else None
    records = [r for r in records if r.index not in skipped]
    return RunOutcome(records, duration, len(requests) - len(records), server, model)


def rate_label(rate: float) -> str:
    """``inf`` or the rate without trailing zeros (for file names and tables)."""
    return "inf" if math.isinf(rate) else f"{rate:g}"
