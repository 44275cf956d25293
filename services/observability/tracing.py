"""One OpenTelemetry trace per request, across the gateway, the prefill worker, the KV transfer
and the decode worker (set-up and propagation: ``otel.py``).

The span tree of one request (names and attributes after the OpenTelemetry GenAI semantic
conventions and vLLM's ``vllm/tracing.py``)::

    {operation} {model}   gateway, SERVER; parent: the client's traceparent, if any
    ├── kv_reservation    gateway: routing + the decode worker's reservation (one per attempt)
    ├── prefill           prefill worker, SERVER: queue and forward time, prompt/cached tokens
    │   └── kv_transfer   backend, bytes, blocks, duration, outcome (explicit start and end)
    └── decode            decode worker, SERVER: output tokens, preemptions, time in the batch
        └── kv_wait       from the reservation to the KV's arrival (or its failure)

The gateway sends its request span's context as gRPC metadata with both worker calls, so the
prefill worker's transfer and the decode worker's wait for the same KV are in one trace.
Retries, migrations, failed transfers, lease expiries and recomputes are events on the request
span (with a ``reason``; the last two also on the decode span, which sees them first and tells
the gateway in ``DecodeResponse.kv_recomputed``). An error sets the span's status and
``error.type``.

Off (the default), every factory returns ``NO_TRACE``, whose methods do nothing: no span,
recording or not, is created; nothing is ever done per token. The engine never calls
OpenTelemetry: worker spans take the engine's ``time.monotonic()`` timestamps afterwards.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from services.observability import otel
from services.observability.otel import configure, enabled, grpc_carrier, shutdown

CANCELLED = (asyncio.CancelledError, GeneratorExit)  # the caller went away: not an error


class _NoSpan:
    """A child span when tracing is off: a context manager whose ``set`` does nothing."""

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def set(self, **attributes) -> None:
        pass


_NO_SPAN = _NoSpan()


class _NoTrace:
    """Tracing off: the API of ``RequestTrace`` and ``WorkerTrace``, doing nothing."""

    ids = (None, None)  # (trace id, span id) for log records

    def metadata(self) -> None:
        return None

    def child(self, name: str, **attributes) -> _NoSpan:
        return _NO_SPAN

    async def kv_wait(self, outcome, policy_recompute: bool = True):
        return await outcome

    def __getattr__(self, name: str):
        return _nothing  # every other method: requested, event, first_token, fail, finish, ...


def _nothing(*args, **kwargs) -> None:
    return None


NO_TRACE = _NoTrace()


class _Child:
    """A live child span as a context manager: ended on exit, failed by an exception."""

    def __init__(self, span) -> None:
        self.span = span

    def __enter__(self) -> _Child:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, CANCELLED):
            otel.set_error(self.span, exc)
        self.span.end()
        return False

    def set(self, **attributes) -> None:
        self.span.set_attributes(attributes)


class RequestTrace:
    """The gateway's span of one request; ``finish`` or ``fail`` ends it (once)."""

    def __init__(self, span) -> None:
        self.span = span
        self.ids = otel.ids(span)
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self._metadata = otel.inject(span)
        self._ended = False

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata (``traceparent``, ``tracestate``) that makes a worker's span a child."""
        return self._metadata

    def requested(self, request_id: str, params, num_prompt_tokens: int) -> None:
        """The validated request: id, sampling settings (``SamplingParams``), prompt tokens."""
        attributes = {
            "gen_ai.response.id": request_id, "gen_ai.request.id": request_id,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.input_tokens": num_prompt_tokens}
        if params.top_k:
            attributes["gen_ai.request.top_k"] = params.top_k
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        self.span.set_attributes(attributes)

    def child(self, name: str, **attributes) -> _Child:
        return _Child(otel.start_span(name, parent_span=self.span, attributes=attributes))

    def event(self, name: str, **attributes) -> None:
        self.span.add_event(name, attributes=attributes)

    def annotate(self, **attributes) -> None:
        """Set attributes on the request span (the routing decision: workers, overlap, cost)."""
        self.span.set_attributes(attributes)

    def first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()

    def prefilled(self, result) -> None:
        """The prefill worker's ``PrefillResponse``: its queue, forward and transfer times."""
        self.span.set_attributes({
            "gen_ai.latency.time_in_queue": result.queue_time_s,
            "gen_ai.latency.time_in_model_prefill": result.compute_time_s,
            "gen_ai.usage.cache_read.input_tokens": result.num_cached_tokens,
            "tandem.kv_transfer.duration_s": result.transfer_time_s,
            "tandem.prefill_worker": result.worker_id})

    def fail(self, exc: BaseException) -> None:
        """End the span failed by ``exc`` (before any token: validation, admission)."""
        if not self._ended:
            otel.set_error(self.span, exc)
            self._end()

    def finish(self, record) -> None:
        """End the span with the outcome of the gateway's ``RequestRecord``: usage, finish
        reason, latencies; a failed request's span gets status ERROR and ``error.type``."""
        if self._ended:
            return
        now = time.monotonic()
        _, fields = record.outcome()
        error = fields.get("error")  # "TypeName: message" or "STATUS_CODE: details"
        attributes = {"gen_ai.usage.output_tokens": record.num_output_tokens,
                      "gen_ai.response.finish_reasons": [fields.get("finish_reason", "error")],
                      "gen_ai.latency.e2e": now - self.arrival}
        if self.first_token_at is not None:
            attributes["gen_ai.latency.time_to_first_token"] = self.first_token_at - self.arrival
            attributes["gen_ai.latency.time_in_model_decode"] = now - self.first_token_at
        self.span.set_attributes(attributes)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_attribute("error.type", error.split(":", 1)[0])
            self.span.set_status(Status(StatusCode.ERROR, error[:500]))
        self._end()

    def _end(self) -> None:
        self._ended = True
        self.span.end()


class WorkerTrace:
    """A worker's span of one request (``prefill`` or ``decode``)."""

    def __init__(self, span) -> None:
        self.span = span
        self.ids = otel.ids(span)
        self.admitted_at: float | None = None  # decode: the request joined the running batch

    def event(self, name: str, **attributes) -> None:
        self.span.add_event(name, attributes=attributes)

    def fail(self, exc: BaseException) -> None:
        if isinstance(exc, CANCELLED):
            self.span.set_attribute("tandem.cancelled", True)
        else:
            otel.set_error(self.span, exc)

    def kv_transfer(self, start_s: float, end_s: float, num_blocks: int, num_bytes: int,
                    backend: str, outcome: str, reason: str = "") -> None:
        """Prefill: the KV write as a child span from ``start_s`` to ``end_s``
        (``time.monotonic()``); ``outcome`` landed or failed (with ``reason``)."""
        span = otel.start_span("kv_transfer", parent_span=self.span, start_s=start_s, attributes={
            "tandem.kv_transfer.backend": backend, "tandem.kv_transfer.blocks": num_blocks,
            "tandem.kv_transfer.bytes": num_bytes, "tandem.kv_transfer.outcome": outcome,
            "tandem.kv_transfer.duration_s": end_s - start_s})
        if outcome != "landed":
            span.set_attribute("tandem.kv_transfer.reason", reason)
            otel.set_error(span, KVTransferFailed(reason))
        span.end(end_time=otel.wall_ns(end_s))

    def end_prefill(self, task: asyncio.Task) -> None:
        """Prefill: end the span with the handoff task's ``PrefillResponse`` or its failure."""
        if task.cancelled():
            self.fail(asyncio.CancelledError())
        elif task.exception() is not None:
            self.fail(task.exception())
        else:
            r = task.result()
            self.span.set_attributes({
                "gen_ai.latency.time_in_queue": r.queue_time_s,
                "gen_ai.latency.time_in_model_prefill": r.compute_time_s,
                "gen_ai.usage.cache_read.input_tokens": r.num_cached_tokens})
        self.span.end()

    async def kv_wait(self, outcome, policy_recompute: bool = True):
        """Decode: await the reservation's ``Outcome`` inside a ``kv_wait`` span; a KV that
        did not land becomes an event (lease expired, transfer failed) and, with the
        recompute policy, a ``recompute`` event."""
        with _Child(otel.start_span("kv_wait", parent_span=self.span)) as wait:
            result = await outcome
            wait.set(**{"tandem.kv_wait.outcome": result.kind})
        if result.kind == "landed":
            self.admitted_at = time.monotonic()
        elif result.kind in ("expired", "not_written"):
            name = "kv_lease_expired" if result.kind == "expired" else "kv_transfer_failed"
            self.event(name, reason=result.why)
            if policy_recompute:
                self.event("recompute", reason=result.why)
                self.admitted_at = time.monotonic()
        return result

    def end_decode(self, req) -> None:
        """Decode: end the span with the engine's ``Request`` (None: never made)."""
        if req is not None:
            attributes = {"gen_ai.usage.output_tokens": len(req.output_token_ids),
                          "tandem.num_preemptions": req.num_preemptions}
            if req.status.finish_reason:
                attributes["gen_ai.response.finish_reasons"] = [req.status.finish_reason]
            if self.admitted_at is not None:
                attributes["gen_ai.latency.time_in_model_decode"] = time.monotonic() - self.admitted_at
            self.span.set_attributes(attributes)
        self.span.end()


class KVTransferFailed(Exception):
    """``error.type`` of a failed ``kv_transfer`` span."""


def request_trace(carrier: Mapping[str, str] | None, operation: str, model: str):
    """The gateway's request span (SERVER), child of the client's ``traceparent`` in
    ``carrier`` (HTTP headers or gRPC metadata); ``NO_TRACE`` when tracing is off.
    ``operation``: chat or text_completion."""
    if not enabled():
        return NO_TRACE
    return RequestTrace(otel.start_span(f"{operation} {model}", carrier, "SERVER", attributes={
        "gen_ai.operation.name": operation, "gen_ai.request.model": model,
        "gen_ai.provider.name": "tandem"}))


def worker_trace(role: str, context, request_id: str, num_prompt_tokens: int):
    """A worker's span (``role``: prefill or decode; SERVER) for one request, child of the
    gateway's span in the gRPC call's metadata; ``NO_TRACE`` when tracing is off."""
    if not enabled():
        return NO_TRACE
    return WorkerTrace(otel.start_span(role, grpc_carrier(context), "SERVER", attributes={
        "tandem.request_id": request_id, "gen_ai.usage.input_tokens": num_prompt_tokens}))


__all__ = ["NO_TRACE", "RequestTrace", "WorkerTrace", "configure", "enabled", "grpc_carrier",
           "request_trace", "shutdown", "worker_trace"]
