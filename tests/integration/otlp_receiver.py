"""An OTLP/gRPC trace receiver for tests, built on opentelemetry-proto's service definitions:
it listens on a free loopback port and keeps every span it is sent, flattened to ``Span``."""
from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto, Status


@dataclass
class Span:
    """One received span; ids in W3C hex (``parent_id`` "" for a root)."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: str  # SERVER, INTERNAL, ...
    service: str  # the resource's service.name
    instance: str  # the resource's service.instance.id ("" if none)
    attributes: dict
    events: list[tuple[str, dict]] = field(default_factory=list)
    error: bool = False  # status ERROR
    start_ns: int = 0
    end_ns: int = 0


def _value(v: AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class OTLPReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """``start()`` returns the endpoint (``http://127.0.0.1:PORT``); ``spans()`` what arrived."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._server: grpc.Server | None = None

    def start(self) -> str:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context):
        received = []
        for rs in request.resource_spans:
            resource = _attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    received.append(Span(
                        s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name,
                        SpanProto.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_"),
                        resource.get("service.name", ""), resource.get("service.instance.id", ""),
                        _attributes(s.attributes),
                        [(e.name, _attributes(e.attributes)) for e in s.events],
                        s.status.code == Status.STATUS_CODE_ERROR,
                        s.start_time_unix_nano, s.end_time_unix_nano))
        with self._lock:
            self._spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()
