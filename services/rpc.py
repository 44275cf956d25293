"""gRPC plumbing shared by the three services: server set-up, health, reflection, and an
interceptor that turns exceptions into status codes (``services.errors.error_status``; no
stack traces reach clients)."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.auth import InternalAuthInterceptor
from services.errors import InvalidArgument, error_status
from services.ports import listen

log = logging.getLogger(__name__)

# trailing metadata of an INVALID_ARGUMENT: the InvalidArgument's field and OpenAI code, so the
# gateway answers a worker's error as the worker raised it (``invalid_argument``)
PARAM_KEY, CODE_KEY = "tandem-error-param", "tandem-error-code"


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
    status = error_status(exc)
    if status.internal:
        log.exception("%s failed", method)
    if status.param is not None:
        context.set_trailing_metadata(((PARAM_KEY, status.param),)
                                      + (((CODE_KEY, status.code),) if status.code else ()))
    await context.abort(grpc.StatusCode[status.grpc_code], status.message)


def invalid_argument(details: str, trailing_metadata) -> ValueError:
    """A peer's INVALID_ARGUMENT as the error its server raised: ``InvalidArgument`` with the
    field (and code) of its ``PARAM_KEY`` (``CODE_KEY``) metadata, else a plain ValueError."""
    fields = dict(trailing_metadata or ())
    param = fields.get(PARAM_KEY)
    if param is None or not details.startswith(f"{param}: "):
        return ValueError(details)
    return InvalidArgument(param, details[len(param) + 2:], fields.get(CODE_KEY))


def create_server(
    service_names: Iterable[str], internal_secret: str | None = None,
    options: Sequence[tuple[str, Any]] = (), first: Sequence[grpc.aio.ServerInterceptor] = (),
    reuse_port: bool = False,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """A ``grpc.aio`` server with the status interceptor, ``grpc.health.v1`` (every service
    reported SERVING) and server reflection; ``options`` are gRPC channel arguments. Add
    servicers, then ``add_insecure_port``.

    With ``internal_secret`` (workers), every call but health and reflection must carry it
    (``services.auth``), or gets UNAUTHENTICATED before its handler runs. ``first``: interceptors
    that run before those (the gateway's API keys). ``reuse_port``: SO_REUSEPORT, so that
    several processes of this host listen on one fixed port (the gateway's
    ``gateway.reuse_port``)."""
    interceptors: list[grpc.aio.ServerInterceptor] = [*first, StatusInterceptor()]
    if internal_secret is not None:
        interceptors.insert(0, InternalAuthInterceptor(internal_secret))
    # no SO_REUSEPORT unless asked (gRPC's default is on): bound to port 0, Linux may hand out a
    # port another process's reuseport listener holds, and the two then split the connections
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.so_reuseport", int(reuse_port)), *options])
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
    """Listen on ``host:port`` (0: a free port below the ephemeral range, see
    ``services.ports``), with TLS when ``credentials`` are given; returns the bound port.
    Raises OSError."""
    def add_port(p: int) -> int:
        address = f"{host}:{p}"
        try:
            bound = (server.add_insecure_port(address) if credentials is None
                     else server.add_secure_port(address, credentials))
        except RuntimeError as exc:  # grpc's "Failed to bind"
            raise OSError(f"cannot listen on {address}: {exc}") from exc
        if bound == 0:
            raise OSError(f"cannot listen on {address}")
        return bound

    return listen(add_port, host, port)
