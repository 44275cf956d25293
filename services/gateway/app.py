"""The gateway process: build the pipeline from the model file and Redis, serve gRPC, publish
truthful health, stop cleanly. Imports no torch, engine or worker runtime."""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.runtime.drain import STOP_GRACE_S, drain_gateway
from services.auth import InternalTls
from services.gateway.access import Access, ApiKeyInterceptor
from services.gateway.health import ReadinessMonitor
from services.gateway.model_card import load_model_header
from services.gateway.pipeline import GatewayCore
from services.gateway.router import RoutingOptions
from services.gateway.routing import WorkerPool
from services.gateway.server import SERVICE_NAME, GatewayServicer, add_gateway_to_server
from services.gateway.tls import CertReloader, TlsFiles, grpc_server_credentials
from services.gateway.validation import RequestLimits
from services.observability.metrics import MetricsServer
from services.rpc import bind, create_server
from services.state.client import redis_client
from services.state.redis_server import check_redis
from services.state.registry import WorkerRegistry
from services.state.store import RequestStateStore

log = logging.getLogger(__name__)

TRANSPORT_CEILING_BYTES = 64 * 1024 * 1024  # gRPC core refuses bodies over max(this, 4x the limit)


@dataclass
class GatewayOptions:
    host: str
    port: int                  # 0: a free port
    redis_url: str
    model: str                 # path of the .gguf file or Hugging Face directory
    rpc_timeout_s: float
    heartbeat_s: float         # the workers' heartbeat; health follows changes within one
    kv_failure_policy: str = "recompute"
    max_inflight: int = 1024   # requests admitted at once; RESOURCE_EXHAUSTED beyond
    limits: RequestLimits = field(default_factory=RequestLimits)
    tokenize_threads: int = 2  # threads rendering chat templates and tokenizing
    http_port: int | None = None  # OpenAI-compatible HTTP on host:http_port (0: free port); None: off
    internal_secret: str | None = None  # sent on every call to a worker (services.auth)
    drain_s: float = 80.0  # after the signal: seconds open streams may finish (services/runtime/drain.py)
    access: Access = field(default_factory=Access)  # API keys and per-key limits (default: open)
    tls: TlsFiles | None = None  # TLS on the gRPC and HTTP listeners (None: plaintext)
    internal_tls: InternalTls | None = None  # mutual TLS to the workers (None: plaintext)
    metrics_port: int = 0  # Prometheus /metrics while http_port is None or reuse_port (0: free)
    # share port and http_port with this host's other gateway processes (SO_REUSEPORT)
    reuse_port: bool = False
    routing: RoutingOptions = field(default_factory=RoutingOptions)  # gateway.routing & co.

    def __post_init__(self) -> None:
        if self.reuse_port and not self.port:
            raise ValueError("gateway.reuse_port: needs a fixed gateway.port (0 would draw a "
                             "free port for each process)")


async def run_gateway(opts: GatewayOptions, until: Awaitable,
                      hurry: asyncio.Event | None = None,
                      on_ready: Callable[[], object] | None = None) -> None:
    """Serve the public Gateway until ``until`` completes (e.g. a signal), then drain
    (``services.runtime.drain.drain_gateway``: readiness fails, new requests get UNAVAILABLE, open
    streams have ``opts.drain_s`` seconds, or until ``hurry`` is set, to finish). ``on_ready`` is
    called once, when every listener is up (the process entry point freezes its start-up heap
    there: ``services.startup_heap``).

    Raises ConnectionError (Redis not answering at start), FileNotFoundError / ValueError
    (model file), OSError (port taken)."""
    await check_redis(opts.redis_url)
    model, tokenizer = await asyncio.to_thread(load_model_header, opts.model)
    redis = redis_client(opts.redis_url)
    registry = WorkerRegistry(redis, opts.heartbeat_s)
    core = GatewayCore(
        tokenizer, model, RequestStateStore(redis),
        WorkerPool(registry, opts.heartbeat_s, opts.rpc_timeout_s, opts.internal_secret,
                   opts.internal_tls), opts.rpc_timeout_s,
        opts.kv_failure_policy, opts.max_inflight, opts.limits, opts.tokenize_threads,
        opts.routing)
    core.router.start()
    ceiling = max(TRANSPORT_CEILING_BYTES, 4 * opts.limits.max_request_bytes)
    server, health = create_server([SERVICE_NAME], options=[("grpc.max_receive_message_length", ceiling)],
                                   first=[ApiKeyInterceptor(opts.access)],
                                   reuse_port=opts.reuse_port)
    add_gateway_to_server(GatewayServicer(core, opts.access), server, opts.limits.max_request_bytes)
    readiness = ReadinessMonitor(registry, health, [SERVICE_NAME], opts.heartbeat_s)
    http = await _start_http(opts, core, readiness)  # NOTE: listening before health can say SERVING
    await readiness.start()
    # before the gRPC server starts: a started server left behind by a failed bind kept the
    # process alive (asyncio.run's teardown waited on it) and deaf to SIGTERM; on a shared port
    # the HTTP port's /metrics and /ready would be any gateway's: each serves its own here
    metrics = None if http and not opts.reuse_port else MetricsServer(
        core.metrics.registry, opts.host, opts.metrics_port,
        ready=lambda: (bool(readiness.ready), readiness.reason))
    bound = bind(server, opts.host, opts.port, grpc_server_credentials(opts.tls) if opts.tls else None)
    await server.start()
    if on_ready is not None:
        on_ready()
    _log_listening(opts, bound, http[1] if http else None, model.name,
                   metrics.port if metrics else http[1])
    try:
        await until
        await drain_gateway(readiness, core, opts.drain_s, hurry)
    finally:
        if metrics:
            await asyncio.to_thread(metrics.close)
        if http:
            http[0].should_exit = True
            await http[2]
            if http[3] is not None:
                http[3].cancel()
        await readiness.stop()
        await health.enter_graceful_shutdown()
        await server.stop(grace=5.0)
        await core.close()
        await redis.aclose()


def _log_listening(opts: GatewayOptions, port: int, http_port: int | None, model: str,
                   metrics_port: int) -> None:
    log.info("gateway listening on %s:%d (gRPC%s%s)%s (model %s, kv failure policy %s, max %d in "
             "flight, API keys %s); health SERVING once a prefill and a decode worker are live; "
             "Prometheus metrics on http://%s:%d/metrics",
             opts.host, port, ", TLS" if opts.tls else "",
             ", a port shared with this host's other gateways" if opts.reuse_port else "",
             f" and http{'s' if opts.tls else ''}://{opts.host}:{http_port} (OpenAI HTTP)"
             if http_port else "", model, opts.kv_failure_policy, opts.max_inflight,
             "required" if opts.access.keys.enabled else "off (open)", opts.host, metrics_port)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with SO_REUSEPORT, for uvicorn to listen on beside
    the other gateway processes of this host. Raises OSError (the port held without
    SO_REUSEPORT, or ``port`` 0: a shared port must be fixed)."""
    if not port:
        raise OSError("gateway.reuse_port needs a fixed http_port: 0 would draw a port of its own")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot serve HTTP on {host}:{port}: {exc.strerror}") from exc
    return sock


async def _serve_http(server, sockets: list[socket.socket] | None, host: str, port: int) -> None:
    """``server.serve(sockets)``, with uvicorn's start-up failure as an OSError naming the
    address. uvicorn logs a failed bind and calls ``sys.exit(3)``; raised in a task, that
    SystemExit would end the process from inside the event loop, with no error of ours."""
    try:
        await server.serve(sockets)
    except SystemExit:
        raise OSError(f"cannot serve HTTP on {host}:{port} (uvicorn's error above says why)") from None


async def _start_http(opts: GatewayOptions, core: GatewayCore, readiness: ReadinessMonitor):
    """(uvicorn server, bound port, serving task, certificate poll task or None) of the HTTP
    front end, or None when off. Raises OSError when the port cannot be bound."""
    if opts.http_port is None:
        return None
    import uvicorn

    from services.gateway.http import HttpServer, create_app

    certs = CertReloader(opts.tls) if opts.tls else None
    sockets = [reuse_port_socket(opts.host, opts.http_port)] if opts.reuse_port else None
    server = HttpServer(uvicorn.Config(
        create_app(core, readiness, opts.access), host=opts.host, port=opts.http_port,
        log_level="warning", lifespan="off", access_log=False,
        ssl_context_factory=(lambda config, default: certs.context) if certs else None,
        # after the drain: streams still open are cut, bounded
        timeout_graceful_shutdown=STOP_GRACE_S,
        log_config=None))  # NOTE: uvicorn logs via ours (json too)
    task = asyncio.ensure_future(_serve_http(server, sockets, opts.host, opts.http_port))
    while not server.started:
        if task.done():
            task.result()  # raises the bind's OSError
            raise OSError(f"cannot serve HTTP on {opts.host}:{opts.http_port}")
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, port, task, asyncio.ensure_future(certs.poll()) if certs else None
