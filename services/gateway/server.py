"""The gateway's gRPC front end: ``tandem.v1.Gateway`` over the shared pipeline
(``pipeline.GatewayCore``), registered so that request bodies arrive as bytes: a body over
``max_request_bytes`` is refused before it is parsed, and one protobuf cannot parse gets
INVALID_ARGUMENT naming the field (``wire.py``)."""
from __future__ import annotations

from contextlib import aclosing

import grpc

from services.api import gateway_pb2
from services.gateway.access import Access, current_identity
from services.gateway.limits import RateLimited
from services.gateway.pipeline import GatewayCore
from services.gateway.wire import raw_handlers
from services.observability.tracing import grpc_carrier

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


class GatewayServicer:
    """``Generate``, ``Abort`` and ``GetRequest``: protocol translation only. The caller's API
    key (``access.ApiKeyInterceptor``) has its limits applied, and sees only its own requests:
    another key's request is unknown to it (Abort: ``found`` false; GetRequest: NOT_FOUND)."""

    def __init__(self, core: GatewayCore, access: Access | None = None) -> None:
        self.core = core
        self.access = access or Access()

    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        identity = current_identity()
        try:
            self.access.check_request(identity)
            prepared = await self.core.prepare(request, grpc_carrier(context))
            record = await self.access.admit(self.core, prepared, identity)
        except RateLimited as exc:  # RESOURCE_EXHAUSTED, with when to retry (as HTTP's header)
            context.set_trailing_metadata((("retry-after", str(exc.retry_after_s)),))
            raise
        async with aclosing(self.core.relay(prepared, record)) as responses:
            async for response in responses:
                yield response

    async def Abort(self, request: gateway_pb2.AbortRequest, context):
        found = self.core.abort(request.request_id, current_identity().key_id)
        return gateway_pb2.AbortResponse(found=found)

    async def GetRequest(self, request: gateway_pb2.GetRequestRequest, context):
        info = await self.core.request_info(request.request_id)
        if info is not None and info.pop("key_id", "") != current_identity().key_id:
            info = None  # another key's request: as unknown as one that never existed
        if info is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: {request.request_id!r} is unknown")
        info["status"] = str(info["status"]).upper()
        return gateway_pb2.RequestInfo(request_id=request.request_id, **info)


def add_gateway_to_server(servicer: GatewayServicer, server: grpc.aio.Server,
                          max_request_bytes: int) -> None:
    """Register ``servicer`` with raw-bytes request handling (see the module docstring)."""
    server.add_generic_rpc_handlers((raw_handlers(SERVICE_NAME, {
        "Generate": (servicer.Generate, gateway_pb2.GenerateRequest, gateway_pb2.GenerateResponse, True),
        "Abort": (servicer.Abort, gateway_pb2.AbortRequest, gateway_pb2.AbortResponse, False),
        "GetRequest": (servicer.GetRequest, gateway_pb2.GetRequestRequest, gateway_pb2.RequestInfo, False),
    }, max_request_bytes),))
