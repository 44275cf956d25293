"""Tracing and log records (services/observability): off means no span at all; on, the spans,
their parents and attributes; JSON log lines carry the request's ids."""
from __future__ import annotations

import asyncio
import contextvars
import io
import json
import logging
import time
from types import SimpleNamespace

import pytest
from opentelemetry import trace as otel_api
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.engine.sampling_params import SamplingParams
from services.observability import otel, tracing
from services.observability.logs import JsonFormatter, RequestContextFilter, bind_request, configure_logging

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"


@pytest.fixture
def exporter():
    spans = InMemorySpanExporter()
    assert tracing.configure("gateway", exporter=spans)
    yield spans
    tracing.shutdown()


def _finished(spans: InMemorySpanExporter) -> dict:
    otel._provider.force_flush()
    return {s.name: s for s in spans.get_finished_spans()}


class FakeContext:
    def __init__(self, metadata):
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata


class FakeRecord:
    num_output_tokens = 7

    def outcome(self):
        return "finished", {"finish_reason": "length"}


@pytest.mark.parametrize("environ, expected", [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
])
def test_tracing_is_on_only_with_an_endpoint(environ, expected):
    assert otel.wanted(None, environ) is expected
    assert otel.wanted("http://setting:4317", {}) is True


def test_off_creates_no_tracer_no_exporter_and_no_span(monkeypatch):
    provider_before = otel_api.get_tracer_provider()
    assert tracing.configure("decode", None, environ={}) is False
    assert not tracing.enabled() and otel._provider is None
    monkeypatch.setattr(otel, "start_span", lambda *a, **k: pytest.fail("a span was created"))
    request = tracing.request_trace({"traceparent": TRACEPARENT}, "chat", "m")
    worker = tracing.worker_trace("decode", FakeContext([("traceparent", TRACEPARENT)]), "r", 3)
    assert request is tracing.NO_TRACE and worker is tracing.NO_TRACE
    assert tracing.grpc_carrier(FakeContext([("traceparent", TRACEPARENT)])) is None
    assert request.metadata() is None  # the worker calls carry no trace metadata
    with request.child("kv_reservation") as span:
        span.set(x=1)
    request.finish(FakeRecord())
    assert asyncio.run(worker.kv_wait(_done("landed"))).kind == "landed"
    assert otel_api.get_tracer_provider() is provider_before  # the global provider untouched


def _done(kind: str) -> asyncio.Future:
    async def outcome():
        return SimpleNamespace(kind=kind, why=f"because {kind}")
    return outcome()


def test_an_unknown_protocol_is_an_error_naming_the_variable():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "zmq"}
    with pytest.raises(ValueError, match="^OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        tracing.configure("gateway", environ=env)
    assert not tracing.enabled()


def test_request_span_continues_the_client_trace_and_carries_genai_attributes(exporter):
    trace = tracing.request_trace({"traceparent": TRACEPARENT}, "chat", "smol")
    trace.requested("req-1", SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5,
                                            seed=3), 11)
    with trace.child("kv_reservation") as span:
        span.set(**{"tandem.decode_worker": "decode-0"})
    trace.event("migration", reason="decode worker decode-0: UNAVAILABLE")
    trace.first_token()
    trace.finish(FakeRecord())
    spans = _finished(exporter)
    root, child = spans["chat smol"], spans["kv_reservation"]
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE_ID
    assert f"{root.parent.span_id:016x}" == CLIENT_SPAN_ID
    assert root.kind == otel_api.SpanKind.SERVER
    assert child.parent.span_id == root.context.span_id
    a = root.attributes
    assert (a["gen_ai.operation.name"], a["gen_ai.request.model"]) == ("chat", "smol")
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.top_k"], a["gen_ai.request.seed"]) == (7, 5, 3)
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (11, 7)
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert 0 <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert [(e.name, e.attributes["reason"]) for e in root.events] == [
        ("migration", "decode worker decode-0: UNAVAILABLE")]


def test_worker_spans_are_children_of_the_gateway_span_with_explicit_times(exporter):
    gateway = tracing.request_trace(None, "text_completion", "smol")
    context = FakeContext(list(gateway.metadata()) + [("x-other", "1"), ("bin-bin", b"\x00")])
    prefill = tracing.worker_trace("prefill", context, "req-2", 40)
    start = time.monotonic() - 2.0
    prefill.kv_transfer(start, start + 0.5, 3, 3 * 4096, "tcp", "landed")
    prefill.kv_transfer(start, start + 0.25, 3, 0, "tcp", "failed", "connection reset")
    prefill.span.end()
    decode = tracing.worker_trace("decode", context, "req-2", 40)
    assert asyncio.run(decode.kv_wait(_done("expired"), policy_recompute=True)).kind == "expired"
    decode.end_decode(None)
    gateway.fail(RuntimeError("boom"))
    otel._provider.force_flush()
    finished = exporter.get_finished_spans()
    by_name = {}
    for s in finished:
        by_name.setdefault(s.name, []).append(s)
    root = by_name["text_completion smol"][0]
    assert {s.context.trace_id for s in finished} == {root.context.trace_id}
    for name in ("prefill", "decode"):
        assert by_name[name][0].parent.span_id == root.context.span_id
    landed, failed = sorted(by_name["kv_transfer"], key=lambda s: s.attributes["tandem.kv_transfer.outcome"])[::-1]
    assert landed.parent.span_id == by_name["prefill"][0].context.span_id
    assert (landed.end_time - landed.start_time) == pytest.approx(0.5e9, abs=2e6)
    assert landed.attributes["tandem.kv_transfer.bytes"] == 3 * 4096
    assert failed.status.status_code == otel_api.StatusCode.ERROR
    assert failed.attributes["error.type"] == "KVTransferFailed"
    wait = by_name["kv_wait"][0]
    assert wait.parent.span_id == by_name["decode"][0].context.span_id
    assert wait.attributes["tandem.kv_wait.outcome"] == "expired"
    assert [e.name for e in by_name["decode"][0].events] == ["kv_lease_expired", "recompute"]
    assert root.status.status_code == otel_api.StatusCode.ERROR
    assert root.attributes["error.type"] == "RuntimeError"


def _log_line(logger_name: str, bound: tuple | None) -> dict:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RequestContextFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    logger.propagate = False

    def emit():
        if bound is not None:
            bind_request(*bound)
        logger.warning("hello %s", "world")

    try:
        contextvars.copy_context().run(emit)
    finally:
        logger.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_json_log_lines_carry_request_trace_and_span_ids():
    trace = SimpleNamespace(ids=(CLIENT_TRACE_ID, CLIENT_SPAN_ID))
    line = _log_line("test.tracing.json", ("req-9", trace))
    assert line["message"] == "hello world" and line["level"] == "WARNING"
    assert (line["request_id"], line["trace_id"], line["span_id"]) == ("req-9", CLIENT_TRACE_ID, CLIENT_SPAN_ID)
    untraced = _log_line("test.tracing.json2", ("req-10", tracing.NO_TRACE))
    assert untraced["request_id"] == "req-10" and "trace_id" not in untraced
    assert "request_id" not in _log_line("test.tracing.json3", None)


def test_log_format_is_checked():
    with pytest.raises(ValueError, match="^log_format"):
        configure_logging("INFO", "xml")
