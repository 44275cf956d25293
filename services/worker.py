"""What prefill and decode workers share: the engine on its own thread bridged to asyncio,
per-request output queues (bounded: ``max_waiting``), registry heartbeats, the GetLoad handler,
and a Redis client that survives Redis outages.

Engine death: when the engine thread dies (``EngineLoop.on_fatal``, or found dead by the
heartbeat), ``engine_died`` fails every open stream with UNAVAILABLE (the gateway migrates or
retries them), every later engine command with UNAVAILABLE, and sets ``died``: the process then
leaves the registry and exits non-zero (``services/serve.py``).
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.api import worker_pb2
from services.engine import commands
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.engine_loop import EngineLoop
from services.engine.outputs import EngineDeadError, RequestOutput
from services.engine.sampler import TokenLogprobs
from services.engine.sampling_params import SamplingParams
from services.kv_transfer import KVTransport, create_transport
from services.rpc import RequestFailed, ResourceExhausted, Unavailable
from services.state.registry import Heartbeater, WorkerInfo, WorkerRegistry

log = logging.getLogger(__name__)


@dataclass
class WorkerOptions:
    role: str  # "prefill" or "decode"
    engine: EngineConfig
    host: str
    advertise_host: str
    port: int
    kv_port: int
    kv_transport: str
    redis_url: str
    heartbeat_s: float
    kv_lease_s: float  # decode: seconds a reservation waits for its KV
    worker_id: str = ""
    max_waiting: int = 256  # requests held outside the running batch; more: RESOURCE_EXHAUSTED
    rpc_timeout_s: float = 600.0  # bound on any wait for the engine thread
    kv_transfer_timeout_s: float = 30.0  # prefill: one KV write (never past the lease)
    fault_injection: bool = False  # TEST ONLY: honour fault tags in request ids (prefill, engine)


REDIS_TIMEOUT_S = 2.0  # connect and per-command socket timeout of the services' Redis clients


def redis_client(url: str) -> aioredis.Redis:
    """A Redis client for a long-running service: every command fails within
    ``REDIS_TIMEOUT_S`` seconds when Redis is unreachable (redis.RedisError), and retries once
    on a fresh connection, so a restarted Redis is used again without any reconnect logic
    (the pool drops a broken connection; nothing keeps a dead one)."""
    return aioredis.Redis.from_url(
        url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S,
        retry=Retry(NoBackoff(), 1))


_SHARED_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos")


def params_from_proto(p: worker_pb2.SamplingParams) -> SamplingParams:
    """Internal proto -> SamplingParams (stop strings stay with the gateway, which owns text)."""
    return SamplingParams(
        **{name: getattr(p, name) for name in _SHARED_FIELDS},
        seed=p.seed if p.HasField("seed") else None, stop_token_ids=tuple(p.stop_token_ids),
        logprobs=p.logprobs if p.HasField("logprobs") else None,
    )


def params_to_proto(p: SamplingParams) -> worker_pb2.SamplingParams:
    return worker_pb2.SamplingParams(
        **{name: getattr(p, name) for name in _SHARED_FIELDS},
        seed=p.seed, stop_token_ids=list(p.stop_token_ids), logprobs=p.logprobs,
    )


def logprobs_to_proto(lp: TokenLogprobs) -> worker_pb2.SampledLogprobs:
    ids, lps = zip(*lp.top) if lp.top else ((), ())
    return worker_pb2.SampledLogprobs(token_id=lp.token_id, logprob=lp.logprob,
                                      top_token_ids=ids, top_logprobs=lps)


class WorkerRuntime:
    """Owns the engine thread; asyncio code awaits ``call`` and reads per-request queues."""

    def __init__(self, options: WorkerOptions, engine: LLMEngine) -> None:
        self.options = options
        self.worker_id = options.worker_id or f"{options.role}-{uuid.uuid4().hex[:8]}"
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self.engine_loop = EngineLoop(engine, self._on_outputs, self._on_fatal)
        self.died = asyncio.Event()  # set once the engine has died (see the module docstring)
        self.endpoint = ""
        self.redis = redis_client(options.redis_url)
        self.registry = WorkerRegistry(self.redis, options.heartbeat_s)
        self.heartbeater = Heartbeater(self.registry, self.info)

    def start(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.engine_loop.start()
        self.heartbeater.start()

    def create_transport(self, port: int) -> KVTransport:
        """The ``options.kv_transport`` backend over this engine's KV cache, listening on
        ``port`` (0: ephemeral; see ``services.kv_transfer.create_transport``)."""
        opts = self.options
        return create_transport(opts.kv_transport, self.engine.kv_cache, self.engine.layout,
                                host=opts.host, port=port, advertise_host=opts.advertise_host)

    async def stop(self) -> None:
        """Stop the engine thread and close Redis (stop ``heartbeater`` first to deregister)."""
        self.engine_loop.stop()
        await self.redis.aclose()

    # engine thread -> event loop
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        self.loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self.streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _on_fatal(self, exc: BaseException) -> None:
        self.loop.call_soon_threadsafe(self.engine_died, exc)

    def engine_died(self, exc: BaseException) -> None:
        """Event loop thread: fail every open stream (UNAVAILABLE) and set ``died``."""
        if self.died.is_set():
            return
        log.critical("%s worker %s: the engine died (%s: %s); failing %d streams",
                     self.options.role, self.worker_id, type(exc).__name__, exc, len(self.streams))
        self.died.set()
        error = f"{type(exc).__name__}: {exc}"
        for rid, queue in self.streams.items():
            queue.put_nowait(RequestOutput(rid, [], None, error=error))

    def check_output(self, out: RequestOutput) -> None:
        """Raise what a stream's output means when it carries an error: ``Unavailable`` once
        the engine died (the gateway retries elsewhere), else ``RequestFailed`` (this request
        alone failed in the engine; its blocks are already freed)."""
        if out.error is None:
            return
        if self.died.is_set():
            raise Unavailable(f"{self.options.role} worker {self.worker_id}: engine stopped "
                              f"({out.error})")
        raise RequestFailed(f"request {out.request_id} failed in the engine: {out.error}")

    async def call(self, command: commands.EngineCommand) -> Any:
        """Apply ``command`` on the engine thread between steps and await its result.

        Raises what the engine raised (``ValueError`` naming a field), ``Unavailable`` when the
        engine has died, and TimeoutError when the engine thread has not run it within
        ``rpc_timeout_s`` (a stuck engine thread must not hang an RPC forever)."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.engine_loop.submit(command)),
                                          self.options.rpc_timeout_s)
        except EngineDeadError as exc:
            raise Unavailable(f"{self.options.role} worker {self.worker_id}: {exc}") from None

    def num_queued(self) -> int:
        """Requests this worker holds outside its running batch: queued, waiting for KV, or
        handing their KV off (plain reads: safe from the event loop thread)."""
        return max(len(self.streams) - len(self.engine.scheduler.running),
                   self.engine.scheduler.num_waiting)

    def open_stream(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        """Accept a request: its output queue. Raises ResourceExhausted when ``max_waiting``
        requests are already queued (bounded memory under overload), ValueError on a
        duplicate id."""
        if request_id in self.streams:
            raise ValueError(f"request_id: {request_id!r} is already in flight on this worker")
        if self.num_queued() >= self.options.max_waiting:
            raise ResourceExhausted(f"{self.options.role} worker {self.worker_id}: "
                                    f"{self.options.max_waiting} requests already queued")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.streams[request_id] = queue
        return queue

    def release(self, request_id: str) -> None:
        """Abort the request on the engine thread, freeing its blocks. Queued at once and not
        awaited: no cancellation of the caller can drop it (``call``'s future can be)."""
        self.engine_loop.submit(commands.Abort(request_id))

    def info(self) -> WorkerInfo:
        """This worker's registry entry. Raises RuntimeError (no heartbeat) once the engine
        thread is dead, after ``engine_died``: a worker without an engine must not be listed."""
        if not self.engine_loop.is_alive() and not self.died.is_set():
            self.engine_died(self.engine_loop.dead or RuntimeError("engine thread is not running"))
        if self.died.is_set():
            raise RuntimeError(f"{self.options.role} worker {self.worker_id}: the engine died")
        load = self.engine.load()  # plain int reads: safe from the event loop thread
        return WorkerInfo(self.worker_id, self.options.role, self.endpoint, **load)

    # shared RPC handler (each role has its own Abort: freeing must wait for KV writes)
    async def GetLoad(self, request, context) -> worker_pb2.WorkerLoad:
        return worker_pb2.WorkerLoad(worker_id=self.worker_id, role=self.options.role,
                                     **self.engine.load())
