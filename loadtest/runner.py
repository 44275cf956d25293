"""The load loop of ``bench serve``: warm-up, then requests sent on an arrival schedule under a
concurrency cap, every loop bounded in count (``len(requests)``) and time (``time_limit_s``
for sending, ``request_timeout_s`` per request).
"""
from __future__ import annotations

import asyncio
import math
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        parse_target(self.target)
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
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
        return GrpcClient(address, timeout_s=cfg.request_timeout_s)
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


async def run_benchmark(cfg: RunConfig, requests: list[SampleRequest]) -> RunOutcome:
    """Run ``requests`` against ``cfg.target`` (see the module doc); failures are recorded,
    not raised. Raises ``ValueError`` on an empty list and ``ConnectionError`` when an HTTP
    target does not list its models (and no model was given)."""
    if not requests:
        raise ValueError("num_prompts must be > 0")
    client = make_client(cfg)
    try:
        model = await client.resolve_model() if isinstance(client, OpenAIClient) else ""
        await _warm_up(client, cfg, requests)
        return await _timed_run(client, cfg, requests, model)
    finally:
        await client.close()


async def _timed_run(client, cfg: RunConfig, requests: list[SampleRequest], model: str) -> RunOutcome:
    times = cfg.schedule.times(len(requests))
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
    for i, (req, at) in enumerate(zip(requests, times)):
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
