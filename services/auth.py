"""Internal authentication: a shared secret that every internal gRPC call and KV connection
proves, so no other local process or pod can drive a worker (reserve blocks, prefill, abort)
or write its KV cache.

- The secret reaches a process as ``internal_secret: str | None``, read by
  ``read_internal_secret`` (through ``Settings.internal_secret()``) from
  ``TANDEM_INTERNAL_SECRET`` or from the file named by ``TANDEM_INTERNAL_SECRET_FILE`` (a
  mounted Kubernetes Secret); ``tandem up`` generates one per run. None: internal ports are unauthenticated (today's behaviour, logged as a warning).
- gRPC: clients send it as ``x-tandem-internal-secret`` metadata (``internal_channel``);
  workers check it in ``InternalAuthInterceptor`` before any handler runs (constant-time
  comparison, never logged). Health and reflection stay open for probes.
- KV ports: the transport's handshake proves it by HMAC over fresh nonces
  (``services.kv_transfer.grants.handshake_proof``); the secret never crosses the wire.

NOTE: over plaintext gRPC the metadata itself can be read by anyone who can sniff the
network; the internal network (a Kubernetes NetworkPolicy) or mutual TLS must keep it private.
"""
from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)

SECRET_ENV = "TANDEM_INTERNAL_SECRET"
SECRET_FILE_ENV = "TANDEM_INTERNAL_SECRET_FILE"
METADATA_KEY = "x-tandem-internal-secret"
OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                 "grpc.reflection.v1.ServerReflection")


def read_internal_secret(value: str | None, path: str | None) -> str | None:
    """The internal secret: ``value`` (setting ``transport.internal_secret``, env
    ``TANDEM_INTERNAL_SECRET``), else the contents of the file ``path``
    (``transport.internal_secret_file``, env ``TANDEM_INTERNAL_SECRET_FILE``: a mounted
    Kubernetes Secret), surrounding whitespace stripped; None when neither is set.

    Raises ValueError naming the variable when both are set, the file cannot be read, or the
    secret is shorter than 16 characters."""
    if value is not None and path:
        raise ValueError(f"{SECRET_ENV}: set it or {SECRET_FILE_ENV}, not both")
    name = SECRET_ENV
    if path:
        name = SECRET_FILE_ENV
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read()
        except OSError as exc:
            raise ValueError(f"{SECRET_FILE_ENV}: cannot read {path!r}: {exc.strerror}") from None
    if value is None:
        return None
    value = value.strip()
    if len(value) < 16:
        raise ValueError(f"{name}: the internal secret must be at least 16 characters")
    return value


def warn_if_open(secret: str | None, what: str) -> None:
    if secret is None:
        log.warning("%s: no internal secret configured (%s / %s): internal gRPC and KV ports "
                    "accept anyone who can reach them", what, SECRET_ENV, SECRET_FILE_ENV)


class InternalAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without the internal secret in ``x-tandem-internal-secret``
    metadata with UNAUTHENTICATED, before its handler runs (``OPEN_SERVICES`` excepted).
    The comparison takes constant time; neither the expected nor the sent value is logged."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.lstrip("/").split("/")[0] in OPEN_SERVICES:
            return handler
        sent = next((v for k, v in details.invocation_metadata or () if k == METADATA_KEY), "")
        sent = sent.encode() if isinstance(sent, str) else bytes(sent)
        if hmac.compare_digest(sent, self._secret):
            return handler
        log.warning("refused %s: %s internal secret", details.method,
                    "wrong" if sent else "no")
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that only answers UNAUTHENTICATED."""
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "internal secret missing or wrong")

    async def deny_stream(request, context):
        await deny(request, context)
        yield  # pragma: no cover - an async generator, as the stream handler's kind requires

    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            deny_stream, handler.request_deserializer, handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            deny, handler.request_deserializer, handler.response_serializer)
    raise NotImplementedError("internal services use unary and server-streaming RPCs only")


def _with_secret(details, pair: tuple[str, str]):
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), pair))


class _UnarySecret(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the internal secret to every unary call's metadata."""

    def __init__(self, secret: str) -> None:
        self._pair = (METADATA_KEY, secret)

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_secret(details, self._pair), request)


class _StreamSecret(grpc.aio.UnaryStreamClientInterceptor):
    """Adds the internal secret to every server-streaming call's metadata.

    NOTE: a separate class from ``_UnarySecret``: grpc.aio files each interceptor under the
    first interceptor kind it is an instance of, so one class serving both misses streams."""

    def __init__(self, secret: str) -> None:
        self._pair = (METADATA_KEY, secret)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_secret(details, self._pair), request)


def internal_channel(endpoint: str, secret: str | None,
                     tls: InternalTls | None = None) -> grpc.aio.Channel:
    """A channel to a worker at ``endpoint`` whose calls carry ``secret`` (none: plain),
    over mutual TLS with ``tls`` (none: plaintext). Raises ValueError (a TLS file unreadable)."""
    interceptors = [] if secret is None else [_UnarySecret(secret), _StreamSecret(secret)]
    if tls is None:
        return grpc.aio.insecure_channel(endpoint, interceptors=interceptors or None)
    return grpc.aio.secure_channel(endpoint, tls.channel_credentials(),
                                   options=tls.channel_options(), interceptors=interceptors or None)


# -- mutual TLS on internal gRPC (gateway -> workers) ----------------------------------------
@dataclass(frozen=True)
class InternalTls:
    """PEM files of one process's internal mutual TLS: its certificate and key, and the CA that
    signed every internal certificate. Workers serve TLS and require a client certificate the
    CA signed; the gateway verifies the worker's certificate against the CA (for the name
    ``server_name``, default: the endpoint's host) and presents its own. Files are read when a
    server starts or a channel opens, so a rotated certificate applies to new channels."""
    cert_file: str
    key_file: str
    ca_file: str
    server_name: str | None = None

    @classmethod
    def from_settings(cls, cert: str | None, key: str | None, ca: str | None,
                      server_name: str | None = None) -> InternalTls | None:
        """None when no file is set. Raises ValueError naming the missing setting."""
        given = {"transport.internal_tls_cert_file": cert, "transport.internal_tls_key_file": key,
                 "transport.internal_tls_ca_file": ca}
        if not any(given.values()):
            return None
        missing = [name for name, value in given.items() if not value]
        if missing:
            raise ValueError(f"{missing[0]}: required with the other internal TLS files")
        return cls(cert, key, ca, server_name)

    def server_credentials(self) -> grpc.ServerCredentials:
        """TLS that requires a client certificate signed by the CA. Raises ValueError."""
        return grpc.ssl_server_credentials(
            [(read_pem(self.key_file, "transport.internal_tls_key_file"),
              read_pem(self.cert_file, "transport.internal_tls_cert_file"))],
            root_certificates=read_pem(self.ca_file, "transport.internal_tls_ca_file"),
            require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca_file, "transport.internal_tls_ca_file"),
            private_key=read_pem(self.key_file, "transport.internal_tls_key_file"),
            certificate_chain=read_pem(self.cert_file, "transport.internal_tls_cert_file"))

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def read_pem(path: str, setting: str) -> bytes:
    """The bytes of a PEM file. Raises ValueError naming ``setting`` when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{setting}: cannot read {path!r}: {exc.strerror}") from None
