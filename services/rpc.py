"""gRPC plumbing shared by the three services: server set-up, health, reflection, and an
interceptor that turns exceptions into status codes (no stack traces reach clients)."""
from __future__ import annotations

import asyncio

import contextlib
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
import pydantic
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.auth import InternalAuthInterceptor

log = logging.getLogger(__name__)


class ResourceExhausted(Exception):
    """No capacity right now (KV blocks, queue); maps to RESOURCE_EXHAUSTED."""


class Unavailable(Exception):
    """A dependency (Redis, every worker of a role) cannot be reached; maps to UNAVAILABLE."""


class RequestFailed(Exception):
    """The engine failed this request alone (running it raised; its blocks are freed); maps to
    INTERNAL with the cause, which names no internal class beyond the exception's type."""


class Aborted(Exception):
    """A worker gave a request up (KV handoff failed or cancelled, lease ended, policy
    ``fail``); maps to ABORTED."""


def validation_message(exc: pydantic.ValidationError) -> str:
    """``'temperature: Input should be greater than or equal to 0'`` for each error."""
    parts = []
    for e in exc.errors():
        msg = str(e.get("ctx", {}).get("error", e["msg"]))  # our own ValueError text, unprefixed
        loc = ".".join(str(p) for p in e["loc"])
        parts.append(f"{loc}: {msg}" if loc else msg)  # model-level checks name their fields
    return "; ".join(parts)


def status_name(exc: BaseException) -> str:
    """The gRPC status code name a front end answers ``exc`` with (CANCELLED: the caller left)."""
    return "CANCELLED" if isinstance(exc, asyncio.CancelledError) else status_for(exc)[0].name


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, pydantic.ValidationError):
        return grpc.StatusCode.INVALID_ARGUMENT, validation_message(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, ResourceExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, Aborted):
        return grpc.StatusCode.ABORTED, str(exc)
    if isinstance(exc, RequestFailed):
        return grpc.StatusCode.INTERNAL, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})"


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Wraps unary and server-streaming handlers: known exceptions become their status code,
    anything else INTERNAL with the traceback logged on the server only."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                try:
                    return await inner(request, context)
                except Exception as exc:  # noqa: BLE001
                    await _abort(context, exc, details.method)

            return grpc.unary_unary_rpc_method_handler(
                unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                try:  # NOTE: aclosing: a client gone mid-stream closes the handler at once
                    async with contextlib.aclosing(inner_stream(request, context)) as items:
                        async for item in items:
                            yield item
                except Exception as exc:  # noqa: BLE001
                    await _abort(context, exc, details.method)

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer)
        return handler


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    if isinstance(exc, grpc.aio.AbortError):  # context.abort() already set the status
        raise exc
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
    await context.abort(code, message)


def create_server(
    service_names: Iterable[str], internal_secret: str | None = None,
    options: Sequence[tuple[str, Any]] = (), first: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """A ``grpc.aio`` server with the status interceptor, ``grpc.health.v1`` (every service
    reported SERVING) and server reflection; ``options`` are gRPC channel arguments. Add
    servicers, then ``add_insecure_port``.

    With ``internal_secret`` (workers), every call but health and reflection must carry it
    (``services.auth``), or gets UNAUTHENTICATED before its handler runs. ``first``: interceptors
    that run before those (the gateway's API keys)."""
    interceptors: list[grpc.aio.ServerInterceptor] = [*first, StatusInterceptor()]
    if internal_secret is not None:
        interceptors.insert(0, InternalAuthInterceptor(internal_secret))
    # no SO_REUSEPORT (gRPC's default): bound to port 0, Linux may hand out a port another
    # process's reuseport listener holds, and the two then split the connections
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.so_reuseport", 0), *options])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return server, health_servicer


async def mark_serving(health_servicer, service_names: Iterable[str]) -> None:
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def mark_not_serving(health_servicer, service_names: Iterable[str]) -> None:
    """Report ``""`` and every name NOT_SERVING (grpc's servicer starts with ``""`` SERVING)."""
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def bind(server: grpc.aio.Server, host: str, port: int,
         credentials: grpc.ServerCredentials | None = None) -> int:
    """Listen on ``host:port`` (0: a free port), with TLS when ``credentials`` are given;
    returns the bound port. Raises OSError."""
    address = f"{host}:{port}"
    bound = (server.add_insecure_port(address) if credentials is None
             else server.add_secure_port(address, credentials))
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return bound
