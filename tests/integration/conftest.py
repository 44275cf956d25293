"""A real stack for integration tests: gateway + prefill + decode processes on 127.0.0.1,
sharing the session's throwaway redis-server; and the helpers every integration test uses to
read the workers' own state (``GetLoad``) and to wait on a condition with a deadline."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import grpc
import pytest
import redis.asyncio as aioredis

from services import ports
from services.auth import internal_channel
from services.api import worker_pb2, worker_pb2_grpc
from services.runtime.launcher import Stack, UpOptions
from services.state.registry import WorkerInfo, WorkerRegistry

WORKER_ARGS = ["--num-threads", "1", "--kv-cache-gib", "0.25", "--heartbeat-s", "0.5"]
WORKER_ROLES = ("prefill", "decode", "unified")
# ends a GetLoad that would hang; a worker's event loop answered one only after 5 s while
# the machine ran at a load average of 20 on 2 cores
GET_LOAD_TIMEOUT_S = 20.0


def free_port() -> int:
    return ports.free_port("127.0.0.1")


@pytest.fixture(scope="package", autouse=True)
def test_defaults() -> Iterator[None]:
    """Stacks and `tandem up` runs here serve no HTTP unless a test asks (``--http-port``):
    the default port 8000 would collide between stacks run in parallel. And they run in the
    oracle mode (float32, dense weights: token-exact against transformers' greedy output) unless
    a test asks for a precision with ``--dtype``/``--quantization`` (flags beat the environment).
    Disaggregated stacks send every prompt through their prefill worker (conditional
    disaggregation off: what the handoff, fault and tracing tests exercise) unless a test asks
    with ``--pd-threshold-tokens`` (``test_routing.py`` does)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_HTTP_PORT", "0")
        mp.setenv("TANDEM_DTYPE", "float32")
        mp.setenv("TANDEM_QUANTIZATION", "none")
        mp.setenv("TANDEM_PD_THRESHOLD_TOKENS", "0")
        yield


def start_stack(worker_args: list[str], redis_url: str | None,
                gateway_args: list[str] = (), num_gateways: int = 1) -> Stack:
    """One prefill + one decode worker and ``num_gateways`` gateways (on one port), ready
    (``redis_url`` None: its own Redis)."""
    s = Stack(UpOptions(host="127.0.0.1", port=free_port(), num_prefill=1, num_decode=1,
                        redis_url=redis_url, worker_args=worker_args,
                        gateway_args=["--heartbeat-s", "0.5", *gateway_args], ready_timeout_s=180,
                        num_gateways=num_gateways))
    try:
        s.start()
        s.wait_ready()
    except BaseException:
        s.stop()
        raise
    return s


class HttpStack:
    """A stack with OpenAI HTTP on: ``url`` (scheme, host, port), ``base_url`` (``url`` + /v1)
    and the official client on it."""

    def __init__(self, stack: Stack, http_port: int) -> None:
        self.stack = stack
        self.http_port = http_port
        self.url = f"http://127.0.0.1:{http_port}"
        self.base_url = f"{self.url}/v1"

    def client(self):
        """An ``openai.AsyncOpenAI`` on the stack (generous timeout, no retries)."""
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key="unused", timeout=300, max_retries=0)


@contextlib.contextmanager
def http_stack_with(redis_url: str | None, gateway_args: list[str],
                    worker_args: list[str] = (), num_gateways: int = 1) -> Iterator[HttpStack]:
    """``start_stack`` with HTTP on a free port, ``gateway_args`` and ``worker_args`` (beside
    ``WORKER_ARGS``); stopped after the block."""
    port = free_port()
    s = start_stack([*WORKER_ARGS, *worker_args], redis_url,
                    gateway_args=["--http-port", str(port), *gateway_args],
                    num_gateways=num_gateways)
    try:
        yield HttpStack(s, port)
    finally:
        s.stop()


@contextlib.contextmanager
def running(s: Stack) -> Iterator[Stack]:
    """``s`` started and ready for the block; stopped after it, whatever happens."""
    try:
        s.start()
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def stack(redis_server) -> Iterator[Stack]:
    s = start_stack(WORKER_ARGS, redis_server.url)
    try:
        yield s
    finally:
        s.stop()


async def wait_until(cond: Callable[[], Awaitable], timeout_s: float, what: str, poll_s: float = 0.05):
    """Await ``cond()`` until it returns something truthy (returned) or ``timeout_s`` seconds
    pass (AssertionError naming ``what`` and the last value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not reached within {timeout_s}s (last: {value!r})"
        await asyncio.sleep(poll_s)


async def registered_workers(redis_url: str) -> list[WorkerInfo]:
    client = aioredis.Redis.from_url(redis_url)
    try:
        registry = WorkerRegistry(client)
        return [w for role in WORKER_ROLES for w in await registry.list(role)]
    finally:
        await client.aclose()


def worker_stub(w: WorkerInfo, channel: grpc.aio.Channel):
    return (worker_pb2_grpc.PrefillWorkerStub if w.role == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(channel)


async def worker_loads(stack: Stack) -> dict[str, worker_pb2.WorkerLoad]:
    """``GetLoad`` of every live worker process of ``stack``, by worker id.

    Raises AssertionError when a live worker is missing from the registry, and lets any RPC
    error through: a report is required from every process that is running."""
    live = {name for name, proc in stack.procs
            if name.split("-")[0] in WORKER_ROLES and proc.poll() is None}
    registered = {w.worker_id: w for w in await registered_workers(stack.redis_url)}
    assert live <= registered.keys(), f"live workers missing from the registry: {live - registered.keys()}"
    out = {}
    for worker_id in sorted(live):
        async with internal_channel(registered[worker_id].endpoint, stack.internal_secret) as ch:
            out[worker_id] = await worker_stub(registered[worker_id], ch).GetLoad(
                worker_pb2.GetLoadRequest(), timeout=GET_LOAD_TIMEOUT_S)
    return out


def busy(loads: dict[str, worker_pb2.WorkerLoad]) -> dict[str, tuple[int, int, int]]:
    """(used KV blocks, running, waiting) of every worker that is not idle."""
    return {w: (l.total_kv_blocks - l.free_kv_blocks, l.num_running, l.num_waiting)
            for w, l in loads.items()
            if l.free_kv_blocks != l.total_kv_blocks or l.num_running or l.num_waiting}


async def assert_all_blocks_freed(stack: Stack, timeout_s: float) -> None:
    """Every live worker process reports zero used KV blocks and no requests within
    ``timeout_s`` seconds (a worker that does not answer fails it at once)."""
    async def check():
        loads = await worker_loads(stack)
        assert loads, "no live worker process"
        left = busy(loads)
        return (not left) or _Busy(left)

    await wait_until(check, timeout_s, "every worker idle with all its KV blocks free")


class _Busy(dict):
    """A falsy report of the workers still busy (for ``wait_until``'s message)."""

    def __bool__(self) -> bool:
        return False


class GatewayThread:
    """``run_gateway(opts)`` on its own thread and event loop, in this process, until ``close()``
    (the gateway drains as on a signal)."""

    def __init__(self, opts) -> None:
        from services.gateway.app import run_gateway

        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self.ready_calls = 0  # run_gateway's on_ready (the process entry point freezes its heap)
        self._thread = threading.Thread(target=self._loop.run_until_complete,
                                        args=(run_gateway(opts, self._wait(),
                                                          on_ready=self._on_ready),))
        self._thread.start()

    async def _wait(self) -> None:
        await self._stop.wait()

    def _on_ready(self) -> None:
        self.ready_calls += 1

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def wait_http_ready(self, url: str, verify=True, timeout_s: float = 300.0) -> None:
        """Until ``url``/ready answers 200 (``verify``: httpx's TLS setting); AssertionError if
        the gateway stops or ``timeout_s`` passes."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            assert self.is_alive(), "the gateway stopped"
            try:
                if httpx.get(f"{url}/ready", verify=verify, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "gateway not ready"
            time.sleep(0.2)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=60)
