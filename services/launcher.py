"""``tandem up``: one gateway, N prefill and M decode workers, and (without REDIS_URL) a
private redis-server, all as child processes of this one; Ctrl-C stops them all."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.process import die_with_parent
from services.state.redis_server import check_redis, start_redis_server
from services.state.registry import WorkerRegistry

log = logging.getLogger(__name__)


@dataclass
class UpOptions:
    host: str
    port: int
    num_prefill: int
    num_decode: int
    redis_url: str | None
    worker_args: list[str]  # passed to every worker (model, KV memory, threads, ...)
    gateway_args: list[str]
    ready_timeout_s: float = 300.0
    env: dict[str, str] | None = None  # extra environment for every child (tests: fault hooks)


class Stack:
    """The running child processes; ``stop()`` ends them (SIGTERM, then SIGKILL)."""

    def __init__(self, opts: UpOptions) -> None:
        self.opts = opts
        self.redis_server = None
        self.redis_url = opts.redis_url
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self) -> None:
        if self.redis_url:
            asyncio.run(check_redis(self.redis_url))
        else:
            self.redis_server = start_redis_server(self.opts.host)
            self.redis_url = self.redis_server.url
            log.info("started redis-server at %s (persistence off)", self.redis_url)
        for i in range(self.opts.num_decode):
            self.add_worker("decode", f"decode-{i}")
        for i in range(self.opts.num_prefill):
            self.add_worker("prefill", f"prefill-{i}")
        self.add_gateway("gateway", self.opts.port)

    def add_worker(self, role: str, worker_id: str, extra_args: list[str] = ()) -> subprocess.Popen:
        """Start one more worker (it joins through the registry; nothing else restarts)."""
        return self._spawn(worker_id, [*self._serve(role), "--worker-id", worker_id,
                                       *self.opts.worker_args, *extra_args])

    def add_gateway(self, name: str, port: int, extra_args: list[str] = ()) -> subprocess.Popen:
        """Start a gateway on ``port``; several gateways share the workers and Redis."""
        return self._spawn(name, [*self._serve("gateway"), "--port", str(port),
                                  *self.opts.gateway_args, *extra_args])

    def _serve(self, role: str) -> list[str]:
        return [sys.executable, "-m", "services.cli", "serve", role,
                "--redis-url", self.redis_url, "--host", self.opts.host]

    def process(self, name: str) -> subprocess.Popen:
        """The child named ``name`` (a worker id, or "gateway"). Raises KeyError."""
        for n, proc in reversed(self.procs):
            if n == name:
                return proc
        raise KeyError(f"no child process named {name!r}")

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        # own session: a terminal's Ctrl-C reaches only us, and we stop children in order;
        # the parent-death signal ends a child even if we are killed with SIGKILL
        env = {**os.environ, **self.opts.env} if self.opts.env else None
        proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent, env=env)
        self.procs.append((name, proc))
        return proc

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}")

    def wait_ready(self) -> None:
        """Block until every worker is registered and the gateway reports SERVING."""
        deadline = time.monotonic() + self.opts.ready_timeout_s
        while not asyncio.run(self._ready()):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"stack not ready within {self.opts.ready_timeout_s:.0f}s")
            time.sleep(0.5)

    async def _ready(self) -> bool:
        redis = aioredis.Redis.from_url(self.redis_url)
        try:
            registry = WorkerRegistry(redis)
            if len(await registry.list("prefill")) < self.opts.num_prefill:
                return False
            if len(await registry.list("decode")) < self.opts.num_decode:
                return False
        finally:
            await redis.aclose()
        async with grpc.aio.insecure_channel(f"{self.opts.host}:{self.opts.port}") as channel:
            try:
                resp = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.aio.AioRpcError:
                return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def stop(self, timeout_s: float = 15.0) -> None:
        gateways_first = sorted(reversed(self.procs), key=lambda p: not p[0].startswith("gateway"))
        for _, proc in gateways_first:  # no new requests, then the workers
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time: killing it", name)
                proc.kill()
                proc.wait()
        if self.redis_server is not None:
            self.redis_server.stop()

    @property
    def address(self) -> str:
        return f"{self.opts.host}:{self.opts.port}"


def run_until_interrupted(stack: Stack) -> None:
    """Supervise: return on SIGINT (Ctrl-C) or SIGTERM, raise if a child dies.

    Both handlers are installed explicitly: a shell starts background jobs with SIGINT ignored,
    and Python then raises no KeyboardInterrupt.
    """
    stop = False

    def _handler(signum, frame):
        nonlocal stop
        stop = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _handler)
    while not stop:
        stack.check_alive()
        time.sleep(0.5)

