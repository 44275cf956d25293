"""The OpenTelemetry SDK behind ``tracing.py``: set-up from ``OTEL_*`` and the settings, span
creation, W3C context propagation. The SDK itself is imported only once tracing is on.

Configured by the standard ``OTEL_*`` environment variables (``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` grpc (default, as
vLLM) or http/protobuf, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER`` / ``_ARG``, ``OTEL_BSP_*``) and the ``otlp_traces_endpoint`` setting
(vLLM's ``--otlp-traces-endpoint``, which wins over the variables). Off unless an endpoint is
given. Propagation follows ``OTEL_PROPAGATORS`` (default: W3C tracecontext and baggage).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)

_provider = None  # opentelemetry.sdk.trace.TracerProvider while tracing is on
_tracer = None  # its Tracer; None: tracing off (the only check on the request path)
PROTOCOLS = ("grpc", "http/protobuf")


def enabled() -> bool:
    return _tracer is not None


def wanted(endpoint: str | None, environ: Mapping[str, str]) -> bool:
    """Whether tracing is asked for: an endpoint (setting or ``OTEL_EXPORTER_OTLP[_TRACES]
    _ENDPOINT``), unless ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(endpoint or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def configure(role: str, endpoint: str | None = None, instance_id: str = "",
              environ: Mapping[str, str] | None = None, exporter: Any = None) -> bool:
    """Start tracing for this process when ``wanted`` (or an ``exporter`` is given: tests);
    returns whether it is on. ``role``: gateway, prefill or decode (``service.name`` is
    ``tandem-ROLE`` unless ``OTEL_SERVICE_NAME`` names one). Spans leave in batches
    (``OTEL_BSP_SCHEDULE_DELAY``, default 5 s) from a background thread.

    Raises ValueError naming ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` for an unknown protocol."""
    global _provider, _tracer
    environ = os.environ if environ is None else environ
    if exporter is None and not wanted(endpoint, environ):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"tandem.role": role}
    if instance_id:
        attributes["service.instance.id"] = instance_id
    if not environ.get("OTEL_SERVICE_NAME") and "service.name=" not in environ.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""):
        attributes["service.name"] = f"tandem-{role}"
    exporter = exporter or _otlp_exporter(endpoint, environ)
    provider = TracerProvider(resource=Resource.create(attributes))  # sampler: OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("tandem")
    log.info("tracing on: %s spans to %s (%s)", role, endpoint or "the OTEL_* endpoint",
             type(exporter).__module__)
    return True


def _otlp_exporter(endpoint: str | None, environ: Mapping[str, str]):
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: {protocol!r} is not one of "
                         f"{', '.join(PROTOCOLS)}")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        if endpoint and urlparse(endpoint).path in ("", "/"):  # as OTEL_EXPORTER_OTLP_ENDPOINT
            endpoint = endpoint.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


def shutdown() -> None:
    """Export what is buffered and stop (at process exit); tracing is off afterwards."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading as nanoseconds since the epoch (a span timestamp)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def grpc_carrier(context) -> dict[str, str] | None:
    """The incoming call's metadata as a propagation carrier; None when tracing is off."""
    if _tracer is None:
        return None
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def extract(carrier: Mapping[str, str] | None):
    from opentelemetry.propagate import extract

    return extract(carrier) if carrier else None


def inject(span) -> tuple[tuple[str, str], ...]:
    from opentelemetry.propagate import inject
    from opentelemetry.trace import set_span_in_context

    carrier: dict[str, str] = {}
    inject(carrier, context=set_span_in_context(span))
    return tuple(carrier.items())


def set_error(span, exc: BaseException) -> None:
    """Mark ``span`` failed by ``exc``: status ERROR, ``error.type`` the exception's type."""
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", type(exc).__name__)
    span.set_status(Status(StatusCode.ERROR, str(exc)[:500]))


def start_span(name: str, parent_carrier: Mapping[str, str] | None = None, kind: str = "INTERNAL",
               parent_span=None, start_s: float | None = None, attributes: dict | None = None):
    """A started span (caller ends it); parent from a carrier, a span, or none (a root)."""
    from opentelemetry.trace import SpanKind, set_span_in_context

    context = (set_span_in_context(parent_span) if parent_span is not None
               else extract(parent_carrier))
    return _tracer.start_span(name, context=context, kind=SpanKind[kind], attributes=attributes,
                              start_time=None if start_s is None else wall_ns(start_s))


def ids(span) -> tuple[str, str]:
    """(trace id, span id) of ``span`` in W3C hex, for log records."""
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
