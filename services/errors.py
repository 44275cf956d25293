"""The errors a client is answered with, and their one mapping to gRPC status and to HTTP
status with OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``).

Code that finds a problem raises the typed error here (``InvalidArgument`` naming the field,
``ResourceExhausted``...); the front ends translate it with ``error_status`` only: the gRPC
interceptor (``services.rpc``) and the HTTP front end (``services.gateway.http``) never read
a message to classify it. Plain ``ValueError`` (pydantic's ``ValidationError`` among them)
stays bad input; ``TimeoutError`` is a deadline; anything else is an internal error whose
message names only its type. No gRPC or HTTP import: the engine raises these too. A worker's
``InvalidArgument`` reaches the gateway whole: ``services.rpc`` sends its field and code as
trailing metadata and ``invalid_argument`` raises it again there.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import pydantic

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code: the prompt does not fit


class ServiceError(Exception):
    """An error with its own status: gRPC ``grpc_code`` (a ``grpc.StatusCode`` name), HTTP
    ``http_status``; ``param`` (the field at fault) and ``code`` (OpenAI's error code) go into
    OpenAI's error body."""

    grpc_code = "INTERNAL"
    http_status = 500
    param: str | None = None
    code: str | None = None


class InvalidArgument(ServiceError, ValueError):
    """Bad input naming its field: INVALID_ARGUMENT, HTTP 400 with ``param``. The message is
    ``'{param}: {reason}'``; ``code`` is OpenAI's (``CONTEXT_LENGTH_EXCEEDED``) or None."""

    grpc_code, http_status = "INVALID_ARGUMENT", 400

    def __init__(self, param: str, reason: str, code: str | None = None) -> None:
        super().__init__(f"{param}: {reason}")
        self.param, self.reason, self.code = param, reason, code

    def __reduce__(self):  # pickles with its fields, not its message
        return type(self), (self.param, self.reason, self.code)

    def renamed(self, param: str) -> InvalidArgument:
        """The same error about ``param`` (a field of another request format)."""
        return type(self)(param, self.reason, self.code)


class BodyTooLarge(InvalidArgument):
    """A request body over ``max_request_bytes``: INVALID_ARGUMENT, HTTP 413."""

    http_status = 413


class NotJson(ServiceError, ValueError):
    """An HTTP body declared (Content-Type) as something other than JSON: 415."""

    grpc_code, http_status = "INVALID_ARGUMENT", 415


class ResourceExhausted(ServiceError):
    """No capacity right now (KV blocks, queue, a per-key limit): RESOURCE_EXHAUSTED, HTTP 429."""

    grpc_code, http_status = "RESOURCE_EXHAUSTED", 429


class Unavailable(ServiceError):
    """A dependency (Redis, every worker of a role) cannot be reached: UNAVAILABLE, HTTP 503."""

    grpc_code, http_status = "UNAVAILABLE", 503


class Aborted(ServiceError):
    """A request given up before it finished (KV handoff failed or cancelled, lease ended,
    policy ``fail``, an Abort call, the gateway stopping): ABORTED, HTTP 503."""

    grpc_code, http_status = "ABORTED", 503


class RequestFailed(ServiceError):
    """The engine failed this request alone (running it raised; its blocks are freed):
    INTERNAL with the cause, which names no internal class beyond the exception's type."""


@dataclass(frozen=True)
class ErrorStatus:
    """What a front end answers an exception with."""

    grpc_code: str  # a grpc.StatusCode name
    http_status: int
    message: str
    param: str | None = None  # OpenAI's error ``param``: the field at fault
    code: str | None = None  # OpenAI's error ``code``

    @property
    def internal(self) -> bool:
        """INTERNAL: the front end logs the traceback (the client sees none)."""
        return self.grpc_code == "INTERNAL"


def error_status(exc: BaseException) -> ErrorStatus:
    """The one mapping of an exception to gRPC status, HTTP status and OpenAI's error fields
    (CANCELLED: the caller left; HTTP 499, nginx's status, is never sent)."""
    if isinstance(exc, ServiceError):
        return ErrorStatus(exc.grpc_code, exc.http_status, str(exc), exc.param, exc.code)
    if isinstance(exc, pydantic.ValidationError):
        return ErrorStatus("INVALID_ARGUMENT", 400, validation_message(exc), _first_field(exc))
    if isinstance(exc, ValueError):
        return ErrorStatus("INVALID_ARGUMENT", 400, str(exc))
    if isinstance(exc, TimeoutError):
        return ErrorStatus("DEADLINE_EXCEEDED", 504, str(exc) or "timed out")
    if isinstance(exc, asyncio.CancelledError):
        return ErrorStatus("CANCELLED", 499, "cancelled")
    return ErrorStatus("INTERNAL", 500, f"internal error ({type(exc).__name__})")


def from_validation(exc: pydantic.ValidationError, names: Mapping[str, str] = {}) -> ValueError:
    """pydantic's error as ``InvalidArgument`` naming its first error's field (each field
    renamed by ``names``: an internal name -> the request's), or a plain ValueError when that
    error names none; the message lists every error (``validation_message``)."""
    message = validation_message(exc, names)
    param = _first_field(exc, names)
    return ValueError(message) if param is None else InvalidArgument(param, message[len(param) + 2:])


def validation_message(exc: pydantic.ValidationError, names: Mapping[str, str] = {}) -> str:
    """``'temperature: Input should be greater than or equal to 0'`` for each error."""
    parts = []
    for e in exc.errors():
        msg = str(e.get("ctx", {}).get("error", e["msg"]))  # our own ValueError text, unprefixed
        loc = _location(e["loc"], names)
        parts.append(f"{loc}: {msg}" if loc else msg)  # model-level checks name their fields
    return "; ".join(parts)


def _first_field(exc: pydantic.ValidationError, names: Mapping[str, str] = {}) -> str | None:
    """The field of the first error: its location, or the field a model-level check's own
    ``InvalidArgument`` names."""
    first = exc.errors()[0]
    cause = first.get("ctx", {}).get("error")
    if not first["loc"] and isinstance(cause, InvalidArgument):
        return cause.param
    return _location(first["loc"], names) or None


def _location(loc: tuple, names: Mapping[str, str]) -> str:
    head = [names.get(str(loc[0]), str(loc[0]))] if loc else []
    return ".".join(head + [str(p) for p in loc[1:]])
