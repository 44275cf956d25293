"""Prometheus metrics of every Tandem process (prometheus-client), named as vLLM v1 names its
own under ``tandem:`` so existing dashboards and autoscalers transfer (vLLM's
``vllm/v1/metrics/loggers.py``; ``docs/architecture.md``, "Metrics", lists every family).

Labels: ``model_name`` (the served name), ``role`` (gateway, prefill, decode, unified) and
``worker_id`` (a worker's registry id; the gateway's host name); ``finished_reason``, ``reason``
and ``code`` where a family says so. Counters are exposed with ``_total`` appended.

- Workers: ``WorkerMetrics``. Engine figures are read at scrape time from the engine's own
  ``EngineMetrics`` (``services/engine/metrics.py``: one source of truth, written only by the
  engine thread, read here without a lock, see there) by a custom collector; KV transfer and
  reservation figures are observed by the servicers.
- Gateway: ``GatewayMetrics``, the request as its client sees it (TTFT, ITL, e2e), outcomes by
  gRPC status code, migrations and retries.

No torch here: the gateway imports this module.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from services.engine.metrics import (FINISH_REASONS, ITL_BUCKETS_S, REQUEST_LATENCY_BUCKETS_S,
                                     TTFT_BUCKETS_S)
from services.engine.metrics import Histogram as StatsHistogram
from services.ports import listen

prometheus_client.disable_created_metrics()  # no ``_created`` series (vLLM does the same)

PREFIX = "tandem:"
LABELS = ("model_name", "role", "worker_id")
# KV transfer: one write of a prompt's blocks (seconds; bytes as 4^k from 1 KiB to 64 GiB)
KV_TRANSFER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                         5.0, 10.0, 30.0)
KV_TRANSFER_BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(14))
KV_FAILURE_REASONS = ("transfer_error", "lease")  # a write failed / the lease ran out first
STATUS_CODES = ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "CANCELLED",
                "ABORTED", "DEADLINE_EXCEEDED", "INTERNAL")
# why the gateway sent a request where it did (services/gateway/scoring.py: REASONS)
ROUTING_REASONS = ("kv_overlap", "load", "threshold", "queue", "fallback", "random")
INDEX_MODES = ("events", "approximate")  # how the prefix index knows a worker's cache
# KV event lag: publisher's drain to the gateway applying the batch (seconds)
KV_EVENT_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                          5.0, 10.0)


def _gauge(name: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
    g.add_metric(labels, value)
    return g


def _counter(name: str, doc: str, labels: list[str], value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
    c.add_metric(labels, value)
    return c


def histogram_family(name: str, doc: str, labels: list[str],
                     h: StatsHistogram) -> HistogramMetricFamily:
    """An engine ``Histogram`` as a Prometheus histogram (cumulative buckets, +Inf last).
    Copies the counts first: the engine thread may observe while this reads."""
    counts, total_sum = list(h.counts), h.sum
    buckets, running = [], 0
    for bound, n in zip((*h.bounds, float("inf")), counts):
        running += n
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    family = HistogramMetricFamily(PREFIX + name, doc, labels=LABELS)
    family.add_metric(labels, buckets, total_sum)
    return family


class EngineCollector(Collector):
    """Snapshots one engine's statistics at scrape time (called on the scraping thread).

    ``engine``: an ``LLMEngine`` (duck-typed: ``metrics``, ``scheduler``, ``block_manager``);
    ``reservations``: returns the decode role's ``Reservations`` or None; ``runtime``: returns
    the ``WorkerRuntime`` (its KV transport and event publisher) or None."""

    def __init__(self, labels: list[str], engine: Any,
                 reservations: Callable[[], Any] = lambda: None,
                 runtime: Callable[[], Any] = lambda: None) -> None:
        self.labels, self.engine, self.reservations = labels, engine, reservations
        self.runtime = runtime

    def collect(self) -> Iterable:
        e, lb = self.engine, self.labels
        m, s, bm = e.metrics, e.scheduler, e.block_manager
        yield _gauge("num_requests_running", "Requests in the running batch.", lb, len(s.running))
        yield _gauge("num_requests_waiting", "Requests waiting: queued, preempted, or waiting for "
                     "their prompt's KV.", lb, s.num_waiting)
        yield _gauge("kv_cache_usage_perc", "KV cache usage: 1 means every block is in use.", lb,
                     1.0 - bm.num_free_blocks / max(bm.num_blocks, 1))
        yield _counter("prefix_cache_queries", "Prefix cache queries, in queried tokens.", lb,
                       m.prefix_cache_queries)
        yield _counter("prefix_cache_hits", "Prefix cache hits, in cached tokens.", lb,
                       m.prefix_cache_hits)
        yield _counter("num_preemptions", "Preemptions (recompute) by the scheduler.", lb,
                       m.num_preemptions)
        stats = m.requests
        yield _counter("prompt_tokens", "Prompt tokens of the prompts this engine computed.", lb,
                       stats.num_prompt_tokens)
        yield _counter("generation_tokens", "Tokens this engine sampled.", lb,
                       m.num_generated_tokens)
        success = CounterMetricFamily(PREFIX + "request_success", "Finished requests.",
                                      labels=(*LABELS, "finished_reason"))
        finished = dict(stats.finished)
        for reason in FINISH_REASONS:
            success.add_metric([*lb, reason], finished.get(reason, 0))
        yield success
        for name, h in stats.histograms().items():
            yield histogram_family(name, name.replace("_", " ") + " (per request).", lb, h)
        runtime = self.runtime()
        transport = getattr(runtime, "transport", None)
        if transport is not None:
            yield _counter("kv_received_bytes", "KV payload bytes written into this worker's "
                           "cache by other workers (receiver side, as read off the wire).", lb,
                           transport.bytes_received)
        publisher = getattr(runtime, "kv_publisher", None)
        if publisher is not None:
            yield _counter("kv_events_published", "KV events (stored, removed, cleared) this "
                           "worker published.", lb, publisher.num_events)
        reservations = self.reservations()
        if reservations is not None:
            yield _gauge("kv_reservations_active", "Open KV reservations (blocks reserved for a "
                         "prompt's KV that has not arrived).", lb, len(reservations))
            yield _counter("kv_lease_expired", "KV reservations whose lease ended before the KV "
                           "arrived.", lb, reservations.closes.get("expired", 0))


class WorkerMetrics:
    """A worker's registry: its engine's figures (``EngineCollector``) and the KV transfer
    figures its servicers observe. Serve it with ``serve_metrics``."""

    def __init__(self, model_name: str, role: str, worker_id: str, engine: Any,
                 reservations: Callable[[], Any] = lambda: None,
                 runtime: Callable[[], Any] = lambda: None) -> None:
        self.labels = [model_name, role, worker_id]
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(self.labels, engine, reservations, runtime))
        kw = {"labelnames": LABELS, "registry": self.registry}
        self.kv_transfer_seconds = Histogram(
            PREFIX + "kv_transfer_seconds", "Duration of one prompt's KV write (prefill side).",
            buckets=KV_TRANSFER_BUCKETS_S, **kw).labels(*self.labels)
        self.kv_transfer_bytes = Histogram(
            PREFIX + "kv_transfer_bytes", "Bytes of one prompt's KV write (prefill side).",
            buckets=KV_TRANSFER_BYTES_BUCKETS, **kw).labels(*self.labels)
        failures = Counter(PREFIX + "kv_transfer_failures", "Prompt KV handoffs that did not "
                           "land, by reason (prefill side).", labelnames=(*LABELS, "reason"),
                           registry=self.registry)
        self.kv_transfer_failures = {r: failures.labels(*self.labels, r) for r in KV_FAILURE_REASONS}

    def transferred(self, seconds: float, num_bytes: int) -> None:
        self.kv_transfer_seconds.observe(seconds)
        self.kv_transfer_bytes.observe(num_bytes)


class GatewayMetrics:
    """The gateway's registry: requests as clients see them. ``in_flight`` returns the number
    of requests admitted and not yet finished (read at scrape time)."""

    def __init__(self, model_name: str, in_flight: Callable[[], int] = lambda: 0,
                 gateway_id: str | None = None) -> None:
        self.labels = [model_name, "gateway", gateway_id or socket.gethostname()]
        self.registry = CollectorRegistry(auto_describe=True)
        kw = {"labelnames": LABELS, "registry": self.registry}

        def histogram(name: str, doc: str, buckets) -> Any:
            return Histogram(PREFIX + name, doc, buckets=buckets, **kw).labels(*self.labels)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token as the client "
                              "sees it (gateway arrival to first token sent).", TTFT_BUCKETS_S)
        self.itl = histogram("inter_token_latency_seconds", "Gap between consecutive tokens sent "
                             "to the client.", ITL_BUCKETS_S)
        self.e2e = histogram("e2e_request_latency_seconds", "Gateway arrival to the last token "
                             "sent, for requests that finished.", REQUEST_LATENCY_BUCKETS_S)
        requests = Counter(PREFIX + "requests", "Requests ended at the gateway, by gRPC status "
                           "code (OK: finished).", labelnames=(*LABELS, "code"), registry=self.registry)
        self.requests = {c: requests.labels(*self.labels, c) for c in STATUS_CODES}
        Gauge(PREFIX + "num_requests_in_flight", "Requests admitted by the gateway and not yet "
              "ended.", **kw).labels(*self.labels).set_function(in_flight)
        self.migrated = Counter(PREFIX + "requests_migrated", "Requests moved to another decode "
                                "worker after theirs failed mid-stream.", **kw).labels(*self.labels)
        self.prefill_retries = Counter(PREFIX + "prefill_retries", "Prefills retried on another "
                                       "worker before the first token.", **kw).labels(*self.labels)
        decisions = Counter(PREFIX + "routing_decisions", "Workers chosen for a request, by "
                            "reason (kv_overlap, load, threshold and queue: prefilled on the "
                            "decode worker, fallback, random).", labelnames=(*LABELS, "reason"),
                            registry=self.registry)
        self.routing_decisions = {r: decisions.labels(*self.labels, r) for r in ROUTING_REASONS}
        self.kv_index_blocks = Gauge(PREFIX + "kv_index_blocks", "Entries of the gateway's "
                                     "prefix index (block hashes per worker, confirmed by KV "
                                     "events or predicted).", **kw).labels(*self.labels)
        workers = Gauge(PREFIX + "kv_index_workers", "Workers in the prefix index by mode: "
                        "events (read from their KV event stream) or approximate (predicted "
                        "from routing).", labelnames=(*LABELS, "mode"), registry=self.registry)
        self.kv_index_workers = {m: workers.labels(*self.labels, m) for m in INDEX_MODES}
        self.kv_handoff_seconds = histogram(
            "kv_handoff_seconds", "A Prefill call's time beyond the prefill worker's queue and "
            "compute: the prompt's KV handoff to the decode worker as the gateway sees it "
            "(transfer, acknowledgement, round trip), which conditional disaggregation weighs.",
            KV_TRANSFER_BUCKETS_S)
        self.kv_event_lag = Histogram(
            PREFIX + "kv_event_lag_seconds", "Publisher's drain of a KV event batch to this "
            "gateway applying it (wall clocks of two processes).", buckets=KV_EVENT_LAG_BUCKETS_S,
            **kw).labels(*self.labels)

    def request_ended(self, code: str, e2e_s: float | None = None) -> None:
        """A request ended with gRPC status ``code``; ``e2e_s`` when it finished."""
        self.requests.get(code, self.requests["INTERNAL"]).inc()
        if e2e_s is not None:
            self.e2e.observe(e2e_s)

    def worker_lost(self, had_tokens: bool) -> None:
        """A worker failed a request: migrated (tokens already sent) or a prefill retry."""
        (self.migrated if had_tokens else self.prefill_retries).inc()


class TokenClock:
    """One request's latencies as its client sees them, into ``GatewayMetrics``: TTFT (gateway
    arrival to the first token sent), one ITL sample per token (the gap since the previous
    message for its first token, 0 for the others that came with it), e2e when it finished.
    Times are ``time.monotonic()`` seconds."""

    def __init__(self, metrics: GatewayMetrics, arrival_time: float) -> None:
        self.metrics, self.arrival_time = metrics, arrival_time
        self.last: float | None = None

    def sent(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival_time)
        else:
            self.metrics.itl.observe(now - self.last)
        for _ in range(num_tokens - 1):
            self.metrics.itl.observe(0.0)
        self.last = now

    def ended(self, code: str) -> None:
        e2e = time.monotonic() - self.arrival_time if code == "OK" else None
        self.metrics.request_ended(code, e2e)


class MetricsServer:
    """``/metrics`` of ``registry`` on ``host:port`` (0: a free port below the ephemeral range,
    ``services.ports``; ``port`` then says which), and with ``ready`` (``() -> (ready, why
    not)``) ``/ready`` of this process (200 or 503, ``{"ready", "reason"}`` as the gateway's
    HTTP ``/ready``)
    from prometheus-client's threaded WSGI server: scrapes run on its threads, never on an
    event loop or the engine thread. Raises OSError when the port cannot be bound.

    NOTE: always the classic text format (0.0.4), whatever the scraper's Accept header asks:
    prometheus-client 0.26 escapes ':' to '_' in sample names of its OpenMetrics output, which
    would rename every ``tandem:`` series that Prometheus (it asks for OpenMetrics) stores."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 ready: Callable[[], tuple[bool, str]] | None = None) -> None:
        app = prometheus_client.make_wsgi_app(registry)

        def text_only(environ, start_response):
            if ready is not None and environ.get("PATH_INFO") == "/ready":
                ok, reason = ready()
                body = json.dumps({"ready": ok, "reason": reason}).encode()
                start_response("200 OK" if ok else "503 Service Unavailable",
                               [("Content-Type", "application/json")])
                return [body]
            return app({**environ, "HTTP_ACCEPT": "text/plain"}, start_response)

        try:
            self._httpd = listen(lambda p: make_server(host, p, text_only, ThreadingWSGIServer,
                                                       handler_class=_QuietHandler), host, port)
        except OSError as exc:  # the message names the address (a port taken meanwhile)
            raise OSError(exc.errno, f"metrics port: cannot listen on {host}:{port}: "
                                     f"{exc.strerror}") from exc
        self.port: int = self._httpd.server_port
        threading.Thread(target=self._httpd.serve_forever, name="metrics", daemon=True).start()

    def close(self) -> None:
        """Stop serving (blocks up to half a second: call it off an event loop)."""
        self._httpd.shutdown()
        self._httpd.server_close()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - no line per scrape
        pass


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """(body, content type) of a scrape of ``registry`` (the classic text format: see
    ``MetricsServer``)."""
    return prometheus_client.generate_latest(registry), prometheus_client.CONTENT_TYPE_LATEST
