"""``tandem up``: one gateway, N prefill and M decode workers (or K unified ones), and (without REDIS_URL) a
private redis-server with a random password, all as child processes of this one, supervised:
a child that dies is restarted (``services/runtime/supervisor.py``); Ctrl-C drains them all
(``Stack.stop``: gateways first, then the workers; a second Ctrl-C hurries them).

Every child reads the same settings object, written once per run as a JSON file readable by
this user only (``--config``), with the per-run internal secret (also in the children's
``TANDEM_INTERNAL_SECRET``) and the Redis password in it; nothing secret is on a command line
or in a log. The children's environment is this one's
without any setting's variable, so the file (plus a test's explicit ``env``) is the whole truth.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import SecretStr

from services.observability.scrape import write_scrape_config
from services.ports import free_port
from services.runtime.layout import WorkerLayout, gpu_placement, visible_gpus
from services.runtime.process import Child, listening, spawn, terminate
from services.config.settings import Device, Settings
from services.config.sources import leaves, load_settings, write_settings_file
from services.state.redis_server import RedisServer, check_redis, start_redis_server
from services.state.registry import WorkerRegistry
from services.runtime.supervisor import RestartPolicy, Supervisor, Unit

log = logging.getLogger(__name__)

STOP_MARGIN_S = 15.0  # beyond a child's drain bound: the gRPC server's stop, process exit
READY_POLL_S = 0.05  # `up` start: how often it looks for the workers and the gateway's health


@dataclass
class UpOptions:
    host: str
    port: int
    num_prefill: int
    num_decode: int
    redis_url: str | None
    worker_args: list[str] = field(default_factory=list)  # extra flags for every worker
    gateway_args: list[str] = field(default_factory=list)  # extra flags for the gateway
    ready_timeout_s: float = 300.0
    num_unified: int = 0  # workers that prefill and decode (services/unified)
    threads: dict[str, int] | None = None  # role -> --num-threads of its workers (None: settings')
    env: dict[str, str] | None = None  # extra environment for every child (tests: fault hooks)
    settings: Settings | None = None  # handed to every child; default: this process's env
    # worker id -> (GPU id, its gpu_memory_utilization): the first of that worker's
    # CUDA_VISIBLE_DEVICES (the stack's other GPUs follow: ``Stack._gpu_order``). Empty: with the
    # settings' engine on CUDA, round-robin over the visible GPUs, the workers of one GPU
    # splitting ``gpu_memory_utilization`` (``layout.gpu_placement``, as `tandem up` does)
    gpus: dict[str, tuple[str, float]] = field(default_factory=dict)
    # gateway processes on ``port`` and the settings' http_port (SO_REUSEPORT: gateway.reuse_port)
    num_gateways: int = 1

    def __post_init__(self) -> None:
        if self.num_gateways > 1 and not self.port:
            raise ValueError("up.num_gateways: gateways share a fixed port; port 0 would draw "
                             "one for each")


def answers_ready(address: str) -> bool:
    """Whether a gateway's /metrics port (``host:port``) answers 200 on ``/ready``: it listens
    and sees Redis and live workers (``MetricsServer``'s ``ready``)."""
    try:
        with urllib.request.urlopen(f"http://{address}/ready", timeout=1.0) as resp:
            return resp.status == 200
    except OSError:  # refused (not listening yet), 503 (HTTPError), timed out
        return False


@dataclass
class RedisUnit:
    server: RedisServer
    name: str = "redis-server"

    def exit_code(self) -> int | None:
        return self.server.process.poll()

    def restart(self) -> None:
        self.server.restart()


PORT_FLAGS = ("--port", "--http-port", "--metrics-port", "--gateway-metrics-port", "--worker-port",
              "--kv-port")


def flag_ports(args: list[str]) -> set[int]:
    """The ports that ``args`` (command-line flags of children) name with ``PORT_FLAGS``, as
    ``--flag N`` or ``--flag=N``."""
    ports = set()
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in PORT_FLAGS:
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if value.isdigit():
                ports.add(int(value))
    return ports


class Stack:
    """The running child processes; ``stop()`` ends them (SIGTERM, then SIGKILL)."""

    def __init__(self, opts: UpOptions) -> None:
        self.opts = opts
        self.redis_server: RedisServer | None = None
        self.redis_url = opts.redis_url
        self.children: list[Child] = []
        self.run_dir: Path | None = None
        self.metrics_targets: dict[str, str] = {}  # child name -> host:port of its /metrics
        self.gateway_ports = {opts.port} - {0}  # gateways' gRPC ports: never drawn for /metrics
        self.gpus: dict[str, tuple[str, float]] = {}  # as UpOptions.gpus, once started

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        """(name, process) of every child, in start order."""
        return [(c.name, c.proc) for c in self.children]

    def start(self) -> None:
        if self.redis_url:
            asyncio.run(check_redis(self.redis_url))
        else:
            self.redis_server = start_redis_server(self.opts.host,
                                                   password=secrets.token_urlsafe(24))
            self.redis_url = self.redis_server.url
            log.info("started redis-server at %s (password set, persistence off)",
                     self.redis_server.safe_url)
        self._write_settings()
        self.gpus = self._gpu_placement()
        for role, count in (("unified", self.opts.num_unified), ("decode", self.opts.num_decode),
                            ("prefill", self.opts.num_prefill)):
            threads = (self.opts.threads or {}).get(role)
            for i in range(count):
                worker_id = f"{role}-{i}"
                args, env = ["--num-threads", str(threads)] if threads else [], None
                if worker_id in self.gpus:
                    gpu, utilization = self.gpus[worker_id]
                    args += ["--gpu-memory-utilization", f"{utilization:.4f}"]
                    env = {"CUDA_VISIBLE_DEVICES": ",".join(self._gpu_order(gpu))}
                self.add_worker(role, worker_id, args, env)
        shared = self.opts.num_gateways > 1
        for i in range(self.opts.num_gateways):
            self.add_gateway("gateway" if i == 0 else f"gateway-{i}", self.opts.port,
                             shared=shared)
        scrape = write_scrape_config(self.run_dir / "prometheus.yml", self.metrics_targets)
        log.info("Prometheus metrics: %s (scrape config: %s)",
                 ", ".join(f"{n} http://{a}/metrics" for n, a in self.metrics_targets.items()), scrape)

    def _gpu_placement(self) -> dict[str, tuple[str, float]]:
        """``opts.gpus``, else where `tandem up` puts the workers when the settings' engine is
        on CUDA: each of two workers sharing an H100 sized its KV cache from 0.9 of the card,
        and the second ran out of memory at start."""
        if self.opts.gpus or self.settings.engine.device != Device.cuda:
            return self.opts.gpus
        layout = WorkerLayout(self.opts.num_prefill, self.opts.num_decode, self.opts.num_unified,
                              self.opts.threads or {}, "stack", tuple(visible_gpus()))
        return gpu_placement(layout, self.settings.engine.gpu_memory_utilization)

    def _gpu_order(self, own: str) -> list[str]:
        """A worker's CUDA_VISIBLE_DEVICES: its own GPU first (its ``cuda`` device), then the
        stack's other GPUs, so that it can open a peer's KV cache on another GPU of this node
        by CUDA IPC (a direct KV write copies between the GPUs; it allocates nothing else
        there but a CUDA context, and only when it does)."""
        placed = dict.fromkeys(gpu for gpu, _ in self.gpus.values())
        return [own, *(gpu for gpu in placed if gpu != own)]

    def _write_settings(self) -> None:
        base = self.opts.settings or load_settings().settings
        secret = base.internal_secret() or secrets.token_urlsafe(32)
        self.settings = base.model_copy(update={
            "host": self.opts.host,
            "state": base.state.model_copy(update={"redis_url": self.redis_url}),
            "gateway": base.gateway.model_copy(update={"port": self.opts.port}),
            "transport": base.transport.model_copy(update={
                "internal_secret": SecretStr(secret), "internal_secret_file": None}),
        })
        self.run_dir = Path(tempfile.mkdtemp(prefix="tandem-up-"))  # mode 0700
        self.settings_file = self.run_dir / "settings.json"
        write_settings_file(self.settings, self.settings_file)
        log.info("children read their settings from %s", self.settings_file)
        names = {leaf.env for leaf in leaves()}
        self.child_env = {k: v for k, v in os.environ.items() if k not in names}
        # NOTE: also in the environment, where the settings of any child process look for it
        self.child_env["TANDEM_INTERNAL_SECRET"] = secret
        self.child_env.update(self.opts.env or {})

    @property
    def internal_secret(self) -> str:
        """The secret the children prove on their internal ports (for clients of this
        process, e.g. tests reading a worker's GetLoad through ``services.auth.internal_channel``)."""
        return self.child_env["TANDEM_INTERNAL_SECRET"]

    def add_worker(self, role: str, worker_id: str, extra_args: list[str] = (),
                   env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start one more worker (it joins through the registry; nothing else restarts), with
        ``env`` added to its environment (its GPU)."""
        port = self._metrics_port(worker_id, self.settings.worker.metrics_port, "worker.metrics_port")
        return self._add(worker_id, [*self._serve(role), "--worker-id", worker_id,
                                     "--metrics-port", str(port), *self.opts.worker_args, *extra_args],
                         env)

    def add_gateway(self, name: str, port: int, extra_args: list[str] = (),
                    shared: bool = False) -> subprocess.Popen:
        """Start a gateway on ``port``; several gateways share the workers and Redis. Only the
        first serves HTTP on the settings' ``http_port`` (and /metrics there); later ones serve
        none (their own ``--http-port`` in ``extra_args`` overrides), so no two gateways claim
        one port, and serve /metrics on a port of their own. ``shared``: every such gateway
        listens on ``port`` and the ``http_port`` together (``gateway.reuse_port``), each with
        /metrics and /ready on a port of its own (``UpOptions.num_gateways``)."""
        serve, g = self._serve("gateway"), self.settings.gateway
        self.gateway_ports.add(port)
        first = not any(c.argv[:len(serve)] == serve for c in self.children)
        http_off = [] if first or shared else ["--http-port", "0"]
        reuse = ["--gateway-reuse-port"] if shared else []
        metrics = []
        if first and g.http_port and not shared:
            self.metrics_targets[name] = f"{self.opts.host}:{g.http_port}"
        else:  # /metrics on a port of its own
            metrics = ["--gateway-metrics-port",
                       str(self._metrics_port(name, g.metrics_port, "gateway.metrics_port"))]
        return self._add(name, [*serve, "--port", str(port), *self.opts.gateway_args, *http_off,
                                *reuse, *metrics, *extra_args])

    def _metrics_port(self, name: str, configured: int, setting: str) -> int:
        """The /metrics port of child ``name``: ``configured``, or a free one when it is 0 (kept
        across restarts: the scrape config stays true). Raises ValueError naming ``setting``
        when two children would share one fixed port."""
        taken = {int(a.rsplit(":", 1)[1]) for a in self.metrics_targets.values()}
        if configured in taken:
            raise ValueError(f"{setting}: port {configured} would be shared by several "
                             "processes of this stack; use 0 (a free port each)")
        port = configured
        # ports a child started earlier may not have bound yet: the other children's /metrics,
        # the gateways' gRPC ports, the first gateway's HTTP port (a free port drawn at random
        # once matched the gRPC port the caller gave the gateway) and any port the caller's
        # child flags name (a test's --http-port was once drawn for a worker's /metrics)
        unbound = (taken | self.gateway_ports | {self.settings.gateway.http_port}
                   | flag_ports([*self.opts.gateway_args, *self.opts.worker_args]))
        while not port or port in unbound:
            port = free_port(self.opts.host)
        self.metrics_targets[name] = f"{self.opts.host}:{port}"
        return port

    def _serve(self, role: str) -> list[str]:
        return [sys.executable, "-m", "services.runtime.cli", "serve", role,
                "--config", str(self.settings_file)]

    def _add(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        env = {**self.child_env, **env} if env else self.child_env
        child = Child(name, argv, env, spawn(argv, env))
        self.children.append(child)
        return child.proc

    def process(self, name: str) -> subprocess.Popen:
        """The child named ``name`` (a worker id, or "gateway"). Raises KeyError."""
        for child in reversed(self.children):
            if child.name == name:
                return child.proc
        raise KeyError(f"no child process named {name!r}")

    def units(self) -> list[Unit]:
        """What a supervisor restarts: every child, and the private redis-server."""
        return [*self.children, *([RedisUnit(self.redis_server)] if self.redis_server else [])]

    def supervisor(self) -> Supervisor:
        s = self.settings.supervisor
        return Supervisor(self.units, RestartPolicy(
            s.restart_limit, s.restart_window_s, s.restart_backoff_s, s.restart_backoff_max_s))

    def check_alive(self) -> None:
        for unit in self.units():
            if unit.exit_code() is not None:
                raise RuntimeError(f"{unit.name} exited with code {unit.exit_code()}")

    def wait_ready(self) -> None:
        """Block until every worker is registered and the gateway reports SERVING (with TLS on
        the gateway: accepts connections; several gateways on one port: each answers ``/ready``
        on its /metrics port), looking every ``READY_POLL_S`` over one Redis client
        and one channel. Raises TimeoutError after ``ready_timeout_s``, RuntimeError when a
        child exits meanwhile."""
        asyncio.run(self._wait_ready(time.monotonic() + self.opts.ready_timeout_s))

    async def _wait_ready(self, deadline: float) -> None:
        redis = aioredis.Redis.from_url(self.redis_url)
        # NOTE: reconnect quickly: a channel refused before the gateway listens backs off (1 s,
        # then more by default) and would see it only that much later
        channel = grpc.aio.insecure_channel(self.address, options=[
            ("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 250)])
        registry = WorkerRegistry(redis)
        try:
            while not await self._ready(registry, channel):
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stack not ready within {self.opts.ready_timeout_s:.0f}s")
                await asyncio.sleep(READY_POLL_S)
        finally:
            await channel.close()
            await redis.aclose()

    async def _ready(self, registry: WorkerRegistry, channel: grpc.aio.Channel) -> bool:
        try:
            for role, count in (("prefill", self.opts.num_prefill), ("decode", self.opts.num_decode),
                                ("unified", self.opts.num_unified)):
                if count and len(await registry.list(role)) < count:
                    return False
        except (redis_errors.RedisError, OSError):  # Redis slow or restarting: not ready yet
            return False
        if self.opts.num_gateways > 1:  # the shared port answers for any one of them: ask each
            gateways = [n for n, _ in self.procs if n.startswith("gateway")]
            return all(await asyncio.gather(*(
                asyncio.to_thread(answers_ready, self.metrics_targets[n]) for n in gateways)))
        if self.settings.gateway.tls_cert_file:  # NOTE: TLS: this process may not trust its CA
            return await listening(self.opts.host, self.opts.port)
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def stop(self, timeout_s: float | None = None) -> None:
        """Drain and end every child (``services/runtime/drain.py``): SIGTERM the gateways and wait
        until they have drained (open streams finished: the workers still serve them), then
        SIGTERM the workers; each group is killed once it outlives its bound (``timeout_s``,
        default: the settings' drain deadlines plus the KV lease). Then Redis."""
        gateways = [(n, p) for n, p in self.procs if n.startswith("gateway")]
        workers = [(n, p) for n, p in self.procs if not n.startswith("gateway")]
        gateway_s, worker_s = (timeout_s, timeout_s) if timeout_s is not None else self._drain_bounds()
        terminate(gateways, gateway_s)
        terminate(workers, worker_s)
        if self.redis_server is not None:
            self.redis_server.stop()
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _drain_bounds(self) -> tuple[float, float]:
        """Seconds (gateways, workers) may take to drain before they are killed."""
        settings = getattr(self, "settings", None)
        if settings is None:  # never started
            return STOP_MARGIN_S, STOP_MARGIN_S
        w = settings.worker
        return (settings.gateway.drain_s + STOP_MARGIN_S,
                max(w.decode_drain_s, w.prefill_drain_s) + w.kv_lease_s + STOP_MARGIN_S)

    def hurry(self) -> None:
        """A second Ctrl-C: signal every live child again (each cuts its drain short)."""
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    @property
    def address(self) -> str:
        return f"{self.opts.host}:{self.opts.port}"


def run_until_interrupted(stack: Stack) -> None:
    """Supervise until SIGINT (Ctrl-C) or SIGTERM: restart any child that dies; raise
    ``CrashLoop`` (naming it) if one keeps dying.

    Both handlers are installed explicitly: a shell starts background jobs with SIGINT ignored,
    and Python then raises no KeyboardInterrupt.
    """
    stop = False

    def _handler(signum, frame):
        nonlocal stop
        if stop:  # again, while the caller drains the stack (Stack.stop): hurry the children
            stack.hurry()
        stop = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _handler)
    stack.supervisor().run(lambda: stop)
