"""Who may use the gateway and how much: API keys (``keys.py``) and per-key limits
(``limits.py``) as both front ends apply them, in one order:

1. authenticate, before any other work (gRPC: ``ApiKeyInterceptor``, before the handler; HTTP:
   ``services/gateway/http_auth.py``, before the body is read): UNAUTHENTICATED / 401;
2. ``check_request``: the key's requests/s, before validation and tokenizing;
3. ``admit``: the key's streams and tokens/min (prompt + max_tokens), then the pipeline's own
   admission; the key id goes into the request's Redis record and its reservation comes back
   when the request ends (reconciled with the tokens it used).

Health and reflection (gRPC) and ``/health``, ``/ready``, ``/metrics`` (HTTP) stay open.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import TYPE_CHECKING

import grpc

from services.gateway.keys import ANONYMOUS, ApiKeys, Identity, Unauthenticated, bearer_token
from services.gateway.limits import KeyLimiter, KeyLimits

if TYPE_CHECKING:
    from services.gateway.pipeline import GatewayCore, Prepared
    from services.gateway.records import RequestRecord

log = logging.getLogger(__name__)

OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                 "grpc.reflection.v1.ServerReflection")
_identity: contextvars.ContextVar[Identity] = contextvars.ContextVar("tandem_identity",
                                                                     default=ANONYMOUS)


class Access:
    """API keys and per-key limits of one gateway (defaults: open, unlimited)."""

    def __init__(self, keys: ApiKeys | None = None, limits: KeyLimits = KeyLimits(),
                 limiter: KeyLimiter | None = None) -> None:
        self.keys = keys or ApiKeys()
        self.limiter = limiter or KeyLimiter(limits)

    def authenticate(self, authorization: str | None) -> Identity:
        """The identity behind an ``Authorization`` value. Raises Unauthenticated."""
        return self.keys.authenticate(bearer_token(authorization))

    def check_request(self, identity: Identity) -> None:
        """Count one request against the key's requests/s. Raises RateLimited."""
        self.limiter.check_request(identity.key_id, identity.name)

    async def admit(self, core: GatewayCore, prepared: Prepared, identity: Identity) -> RequestRecord:
        """``admit_all`` for a request of one choice."""
        return (await self.admit_all(core, [prepared], identity))[0]

    async def admit_all(self, core: GatewayCore, choices: list[Prepared],
                        identity: Identity) -> list[RequestRecord]:
        """The key's stream place and tokens for a request's ``choices`` (n > 1: one stream,
        every choice's tokens), then ``core.admit_all`` with the key id recorded; the place and
        the unused tokens come back when the last choice ends.

        Raises RateLimited (nothing taken), and whatever ``core.admit_all`` raises (the key's
        reservation given back)."""
        cost = sum(len(p.prompt) + p.params.max_tokens for p in choices)
        lease = self.limiter.acquire(identity.key_id, cost, identity.name)
        try:
            records = await core.admit_all(choices, key_id=identity.key_id)
        except BaseException:
            lease.release()
            raise
        used, left = [0], [len(records)]

        prompt_tokens = {id(r): len(p.prompt) for r, p in zip(records, choices)}

        def finished(record: RequestRecord) -> None:
            used[0] += prompt_tokens[id(record)] + record.num_output_tokens
            left[0] -= 1
            if not left[0]:
                lease.release(used[0])

        for record in records:
            record.on_finish(finished)
        return records


def current_identity() -> Identity:
    """The identity of the gRPC call being handled (set by ``ApiKeyInterceptor``)."""
    return _identity.get()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without an accepted key in ``authorization: Bearer KEY`` metadata
    with UNAUTHENTICATED before its handler runs (``OPEN_SERVICES`` excepted); an accepted
    call's handler runs with ``current_identity()`` set. Keys are never logged."""

    def __init__(self, access: Access) -> None:
        self.access = access

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.lstrip("/").split("/")[0] in OPEN_SERVICES:
            return handler
        sent = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        if isinstance(sent, bytes):
            sent = sent.decode("latin-1")
        try:
            identity = self.access.authenticate(sent)
        except Unauthenticated as exc:
            log.info("refused %s: %s", details.method, exc)
            return _wrap(handler, None, str(exc))
        return _wrap(handler, identity, "")


def _wrap(handler: grpc.RpcMethodHandler, identity: Identity | None,
          refusal: str) -> grpc.RpcMethodHandler:
    """``handler`` run with ``identity`` as the current one; None: answer UNAUTHENTICATED."""
    if handler.unary_unary:
        inner = handler.unary_unary

        async def unary(request, context):
            if identity is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
            _identity.set(identity)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer)
    if handler.unary_stream:
        inner_stream = handler.unary_stream

        async def stream(request, context):
            if identity is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
            _identity.set(identity)
            async with contextlib.aclosing(inner_stream(request, context)) as items:
                async for item in items:  # NOTE: aclosing: a client gone closes it at once
                    yield item

        return grpc.unary_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer)
    raise NotImplementedError("the gateway serves unary and server-streaming RPCs only")


def exposure_options(s) -> dict:
    """``GatewayOptions`` fields ``access``, ``tls`` and ``internal_tls`` from the settings tree
    ``s`` (``services/config/settings.py``). Raises ValueError naming the setting at fault."""
    from services.auth import InternalTls
    from services.gateway.tls import TlsFiles

    g, t = s.gateway, s.transport
    keys = ApiKeys(g.api_key.get_secret_value() if g.api_key else None, g.api_keys_file or None)
    limits = KeyLimits(g.rate_limit_requests_per_s, g.rate_limit_tokens_per_min, g.max_streams_per_key)
    return {"access": Access(keys, limits),
            "tls": TlsFiles.from_settings(g.tls_cert_file, g.tls_key_file, g.tls_client_ca_file),
            "internal_tls": InternalTls.from_settings(
                t.internal_tls_cert_file, t.internal_tls_key_file, t.internal_tls_ca_file,
                t.internal_tls_server_name)}
