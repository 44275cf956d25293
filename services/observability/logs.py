"""Logging for every Tandem process, configured in one place (``configure_logging``): text (a
person reading a terminal) or JSON (one object per line, for log collectors), and on every
record the request being served (``request_id``) and, while tracing, its ``trace_id`` and
``span_id`` (W3C hex, as the trace backend shows them).

A request's ids are bound to the asyncio task that serves it (``bind_request``, a context
variable): every log line written while serving it, in that task or in tasks it starts, carries
them, with no change to the ``log.info(...)`` calls themselves.
"""
from __future__ import annotations

import contextvars
import json
import logging
import sys
from datetime import datetime, timezone

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(request_context)s"

# (request id, trace id or None, span id or None) of the request this task serves
_request: contextvars.ContextVar[tuple[str, str | None, str | None] | None] = \
    contextvars.ContextVar("tandem_request", default=None)


def bind_request(request_id: str, trace=None) -> None:
    """Tag this task's later log records (and those of tasks it starts) with ``request_id``
    and the ids of ``trace`` (a ``tracing`` trace; ``NO_TRACE`` or None: no trace ids)."""
    trace_id, span_id = getattr(trace, "ids", (None, None))
    _request.set((request_id, trace_id, span_id))


class RequestContextFilter(logging.Filter):
    """Adds ``request_id``, ``trace_id``, ``span_id`` (None outside a request) and
    ``request_context`` (the text format's suffix) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = _request.get()
        record.request_id, record.trace_id, record.span_id = bound or (None, None, None)
        if bound is None:
            record.request_context = ""
        elif bound[1] is None:
            record.request_context = f" [request_id={bound[0]}]"
        else:
            record.request_context = f" [request_id={bound[0]} trace_id={bound[1]} span_id={bound[2]}]"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (ISO 8601, UTC), ``level``, ``logger``,
    ``message``, ``request_id`` / ``trace_id`` / ``span_id`` when set, ``exception`` when
    one is logged."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                   timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for key in ("request_id", "trace_id", "span_id"):
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Route the root logger to stderr in ``fmt`` (text or json) at ``level``, replacing any
    handler set before. Raises ValueError naming ``log_format`` for another format."""
    if fmt not in FORMATS:
        raise ValueError(f"log_format: {fmt!r} is not one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
