"""What an engine accumulates over its steps: sums for benchmarks (read and reset them) and the
per-request statistics a worker exports to Prometheus (``services/observability/metrics.py``
reads them at scrape time; this module imports no exporter).

Writers: only the engine thread. Readers on other threads copy a ``Histogram``'s lists and the
finish-reason dict (each copy is atomic under the GIL); a scrape may see one request's
observation in one histogram and not yet in another, never a torn number.

Intervals per request (vLLM v1's definitions, ``vllm/v1/metrics/stats.py``), all
``time.monotonic()`` seconds: TTFT = arrival -> first token; queue = arrival (for a prompt whose
KV another worker computed: the KV's landing) -> first scheduled; prefill = first scheduled ->
first token, only for prompts this engine computed; decode = first -> last token;
e2e = arrival -> finish; ITL = gap between a request's consecutive tokens.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from .request import (RequestStatus, block_table_of, is_padding_of, last_token_time_of,
                      num_computed_of, status_of)

if TYPE_CHECKING:
    from .outputs import RequestOutput
    from .request import Request
    from .scheduler import Scheduler, SchedulerOutput

STEP_PHASES = ("schedule", "prepare_inputs", "forward", "sample", "postprocess")

# Bucket upper bounds, vLLM v1's (``vllm/v1/metrics/loggers.py``), so dashboards transfer.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                             40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort")


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``: the token
    count buckets, sized by the model's context length)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1


@dataclass
class Histogram:
    """Counts per bucket (``counts[i]``: observations <= ``bounds[i]`` and > the bound before;
    the last entry is the +Inf bucket) and their ``sum``: Prometheus' model, without an
    exporter. ``observe`` is O(log buckets)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, count: int = 1) -> None:
        """Add ``count`` observations of ``value``."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass
class RequestStats:
    """Per-request histograms and counters (module docstring: what each interval means).

    A request counts toward ``finished``, e2e, decode time and the token-count histograms only
    where its output ends: not on a prefill worker, which hands the request on after its first
    token (``hold_kv_on_finish``), so each request is counted once across the pools."""

    max_model_len: int = 8192
    num_prompt_tokens: int = 0  # prompts whose first token this engine sampled, tokens
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))

    def __post_init__(self) -> None:
        self.landed: dict[str, Request] = {}  # remote prompt KV landed, not yet scheduled
        tokens = buckets_1_2_5(self.max_model_len)
        self.time_to_first_token = Histogram(TTFT_BUCKETS_S)
        self.inter_token_latency = Histogram(ITL_BUCKETS_S)
        self.e2e_request_latency = Histogram(REQUEST_LATENCY_BUCKETS_S)
        self.request_queue_time = Histogram(REQUEST_LATENCY_BUCKETS_S)
        self.request_prefill_time = Histogram(REQUEST_LATENCY_BUCKETS_S)
        self.request_decode_time = Histogram(REQUEST_LATENCY_BUCKETS_S)
        self.request_prompt_tokens = Histogram(tokens)
        self.request_generation_tokens = Histogram(tokens)
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)

    def histograms(self) -> dict[str, Histogram]:
        """Each histogram by its vLLM metric name (without the ``tandem:`` prefix)."""
        return {"time_to_first_token_seconds": self.time_to_first_token,
                "inter_token_latency_seconds": self.inter_token_latency,
                "e2e_request_latency_seconds": self.e2e_request_latency,
                "request_queue_time_seconds": self.request_queue_time,
                "request_prefill_time_seconds": self.request_prefill_time,
                "request_decode_time_seconds": self.request_decode_time,
                "request_prompt_tokens": self.request_prompt_tokens,
                "request_generation_tokens": self.request_generation_tokens,
                "iteration_tokens_total": self.iteration_tokens}

    def on_token(self, request: Request, now: float, computed_here: bool = True) -> None:
        """``request`` got its newest output token at ``now``. ``computed_here``: False for a
        first token sampled by another worker (its prompt KV just landed here)."""
        if request.first_token_time is None:
            request.first_token_time = now
            self.time_to_first_token.observe(now - request.arrival_time)
            if computed_here:
                self.num_prompt_tokens += request.num_prompt_tokens
                self.request_queue_time.observe(request.first_scheduled_time - request.arrival_time)
                self.request_prefill_time.observe(now - request.first_scheduled_time)
        elif request.last_token_time is not None:
            self.inter_token_latency.observe(now - request.last_token_time)
        request.last_token_time = now
        if request.is_finished():
            self.on_finish(request, now)

    def on_tokens(self, requests: Sequence[Request], now: float) -> None:
        """``on_token(r, now)`` for each of ``requests``: one call per step. In the usual
        step every request is past its first token and none finished, and their last tokens
        came at a few times (most at the previous step's): one inter-token latency
        observation per distinct time, counted for its requests."""
        lasts = Counter(map(last_token_time_of, requests))
        if None in lasts or max(map(status_of, requests), default=0) > RequestStatus.PREEMPTED:
            for r in requests:  # a first token or a finish among them
                self.on_token(r, now)
            return
        for last, count in lasts.items():
            self.inter_token_latency.observe(now - last, count)
        for r in requests:
            r.last_token_time = now

    def on_admitted(self, request: Request) -> None:
        """First scheduled after its prompt KV landed from another worker: its queue time."""
        self.request_queue_time.observe(request.first_scheduled_time - request.first_token_time)

    def on_remote_first_token(self, request: Request, now: float) -> None:
        """The prompt's KV and first token landed from another worker at ``now``."""
        self.on_token(request, now, computed_here=False)
        if not request.is_finished():
            self.landed[request.request_id] = request  # its queue time starts now

    def on_finish(self, request: Request, now: float) -> None:
        """``request`` has finished (any status; aborted ones too)."""
        reason = request.status.finish_reason
        self.landed.pop(request.request_id, None)
        if request.hold_kv_on_finish or reason is None:
            return  # a prefill handoff: its decode worker counts the request
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.e2e_request_latency.observe(now - request.arrival_time)
        if request.first_token_time is not None:
            self.request_decode_time.observe(request.last_token_time - request.first_token_time)
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(len(request.output_token_ids))


@dataclass
class EngineMetrics:
    """Sums over steps (divide by ``num_steps`` for means). Times in seconds, sizes in tokens.

    On CUDA the forward pass is asynchronous: ``forward`` then only covers the launch and the
    wait shows up in ``sample`` (which synchronises when it reads the tokens back).
    ``requests``: the per-request statistics (``RequestStats``); ``max_model_len`` sizes its
    token-count buckets.
    """

    num_steps: int = 0
    num_batched_tokens: int = 0  # tokens through the model
    num_scheduled_seqs: int = 0  # running batch size, summed over steps
    num_generated_tokens: int = 0
    kv_allocated_slots: int = 0  # block slots held by scheduled requests, summed over steps
    kv_used_slots: int = 0  # of those, slots holding a token's KV after the step
    kv_used_blocks: int = 0  # blocks in use in the whole pool, summed over steps
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found (their KV reused)
    num_preemptions: int = 0
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))
    max_model_len: int = 8192
    requests: RequestStats = field(init=False)

    def __post_init__(self) -> None:
        self.requests = RequestStats(self.max_model_len)

    def timed(self, phase: str, fn: Callable, *args):
        """``fn(*args)``, its wall time added to ``phase_s[phase]`` (seconds)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.phase_s[phase] += time.perf_counter() - t0

    def record_step(self, out: SchedulerOutput, scheduler: Scheduler,
                    outputs: Sequence[RequestOutput]) -> None:
        """Add one step that ran ``out`` and produced ``outputs`` (one new token each)."""
        self.num_steps += 1
        self.num_batched_tokens += out.total_num_scheduled_tokens
        self.num_scheduled_seqs += len(out.scheduled)
        self.num_generated_tokens += len(outputs)
        bm, reqs = scheduler.block_manager, out.scheduled
        slots = [len(table) * bm.block_size for table in map(block_table_of, reqs)]
        used = sum(map(min, map(num_computed_of, reqs), slots))
        if any(map(is_padding_of, reqs)):  # a static batch's padding rows hold slots no request uses
            used -= sum(min(r.num_computed_tokens, n) for r, n in zip(reqs, slots) if r.is_padding)
        self.kv_allocated_slots += sum(slots)
        self.kv_used_slots += used
        self.kv_used_blocks += bm.num_used_blocks
        self.num_preemptions = scheduler.num_preemptions
        self.prefix_cache_queries = scheduler.prefix_cache_queries  # cumulative, tokens
        self.prefix_cache_hits = scheduler.prefix_cache_hits
        self._record_requests(out, outputs)

    def _record_requests(self, out: SchedulerOutput, outputs: Sequence[RequestOutput]) -> None:
        stats, now = self.requests, time.monotonic()
        stats.iteration_tokens.observe(out.total_num_scheduled_tokens)
        if len(outputs) == len(out.scheduled):  # every request of the step output, in order
            stats.on_tokens(out.scheduled, now)
        else:
            by_id = {r.request_id: r for r in out.scheduled}
            for o in outputs:
                request = by_id.get(o.request_id)
                if request is not None:
                    stats.on_token(request, now)
        if stats.landed:  # prompts whose KV came from another worker, admitted this step
            for request in out.scheduled:
                if request.request_id in stats.landed:
                    stats.on_admitted(stats.landed.pop(request.request_id))

    @property
    def mean_batch_size(self) -> float:
        return self.num_scheduled_seqs / max(self.num_steps, 1)

    @property
    def kv_waste(self) -> float:
        """Allocated but unused slots / allocated slots (PagedAttention's internal waste)."""
        return 1.0 - self.kv_used_slots / max(self.kv_allocated_slots, 1)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / max(self.prefix_cache_queries, 1)

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "requests"}
        d.update(mean_batch_size=self.mean_batch_size, kv_waste=self.kv_waste,
                 prefix_cache_hit_rate=self.prefix_cache_hit_rate)
        return d
