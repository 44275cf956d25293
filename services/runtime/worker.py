"""What prefill and decode workers share: the engine on its own thread bridged to asyncio,
per-request output queues (bounded: ``max_waiting``), registry heartbeats, the GetLoad handler,
and a Redis client that survives Redis outages.

Engine death: when the engine thread dies (``EngineLoop.on_fatal``, or found dead by the
heartbeat), ``engine_died`` fails every open stream with UNAVAILABLE (the gateway migrates or
retries them), every later engine command with UNAVAILABLE, and sets ``died``: the process then
leaves the registry and exits non-zero (``services/runtime/serve.py``).
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Protocol


from services.api import worker_pb2
from services.auth import InternalTls
from services.engine import commands
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.engine_loop import EngineLoop
from services.engine.outputs import EngineDeadError, RequestOutput
from services.engine.request import Request, RequestStatus
from services.kv_transfer import KVTransport, create_transport
from services.errors import InvalidArgument, RequestFailed, ResourceExhausted, Unavailable
from services.state.client import redis_client
from services.state.kv_events import KVEventPublisher
from services.state.registry import Heartbeater, WorkerInfo, WorkerRegistry

log = logging.getLogger(__name__)


@dataclass
class WorkerOptions:
    role: str  # "prefill", "decode" or "unified" (prefills and decodes; services/unified)
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
    drain_s: float = 30.0  # SIGTERM: seconds running requests may finish (services/runtime/drain.py)
    fault_injection: bool = False  # TEST ONLY: honour fault tags in request ids (prefill, engine)
    internal_secret: str | None = None  # services.auth: proven on gRPC and KV ports; None: open
    internal_tls: InternalTls | None = None  # services.auth: mutual TLS on the gRPC port; None: off
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port (0: a free port)
    publish_kv_events: bool = True  # prefix cache stored/removed/cleared to Redis (state/kv_events.py)


class OutputSink(Protocol):
    """Where an open request's engine outputs go, on the event loop thread: its
    ``asyncio.Queue``, or a followed decode stream itself (``services/decode/server.py``), which
    sends them on without a queue."""

    def put_nowait(self, item: RequestOutput) -> None: ...


class WorkerRuntime:
    """Owns the engine thread; asyncio code awaits ``call`` and reads per-request queues."""

    def __init__(self, options: WorkerOptions, engine: LLMEngine) -> None:
        self.options = options
        self.worker_id = options.worker_id or f"{options.role}-{uuid.uuid4().hex[:8]}"
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.streams: dict[str, OutputSink] = {}  # request id -> where its outputs go
        self.max_num_queued = 0  # high-water mark of num_queued(), taken at each admission
        self.reservations = None  # decode role: its Reservations (GetLoad reports their closes)
        self.metrics = None  # its services.observability.metrics.WorkerMetrics, once serving
        self.engine_loop = EngineLoop(engine, self._on_outputs, self._on_fatal)
        self.died = asyncio.Event()  # set once the engine has died (see the module docstring)
        self.draining = False  # told to stop (services/runtime/drain.py): new requests get UNAVAILABLE
        self.handed_back = False  # drain deadline passed: open streams end with UNAVAILABLE
        self.endpoint = ""
        self.redis = redis_client(options.redis_url)
        self.registry = WorkerRegistry(self.redis, options.heartbeat_s)
        self.heartbeater = Heartbeater(self.registry, self.info)
        self.kv_publisher: KVEventPublisher | None = None  # with engine.kv_events, once started
        self.transport: KVTransport | None = None  # once create_transport made it

    def start(self, endpoint: str, model_name: str = "") -> None:
        """Start the engine thread, heartbeats and (when the engine records them) KV events
        named for ``model_name`` (the served model's name, in the stream's header)."""
        self.endpoint = endpoint
        self.engine_loop.start()
        self.heartbeater.start()
        if self.engine.kv_events is not None:
            bm = self.engine.block_manager
            self.kv_publisher = KVEventPublisher(
                self.redis, self.worker_id, model_name, bm.block_size, self.engine.kv_events,
                bm.cached_hashes, lambda: bm.num_cached_blocks, self.registry.ttl_s)
            self.kv_publisher.start()

    async def stop_kv_events(self) -> None:
        """Publish "cleared" and stop publishing KV events (drain, engine death, shutdown):
        gateways stop expecting this cache at once."""
        if self.kv_publisher is not None:
            publisher, self.kv_publisher = self.kv_publisher, None
            await publisher.stop(clear=True)

    def create_transport(self, port: int) -> KVTransport:
        """The ``options.kv_transport`` backend over this engine's KV cache, listening on
        ``port`` (0: ephemeral; see ``services.kv_transfer.create_transport``)."""
        opts = self.options
        self.transport = create_transport(
            opts.kv_transport, self.engine.kv_cache, self.engine.layout, host=opts.host,
            port=port, advertise_host=opts.advertise_host, secret=opts.internal_secret,
            require_grants=True)
        return self.transport

    async def stop(self) -> None:
        """Stop the engine thread and close Redis (stop ``heartbeater`` first to deregister)."""
        await self.stop_kv_events()
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
        if self.died.is_set() or self.handed_back:
            raise Unavailable(f"{self.options.role} worker {self.worker_id}: "
                              f"{'handed back' if self.handed_back else 'engine stopped'} "
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
        """Accept a request: its output queue. Raises Unavailable while draining,
        ResourceExhausted when ``max_waiting`` requests are already queued (bounded memory under
        overload), ValueError on a duplicate id."""
        if self.draining:
            raise Unavailable(f"{self.options.role} worker {self.worker_id} is draining "
                              "(shutting down): use another worker")
        if request_id in self.streams:
            raise InvalidArgument("request_id", f"{request_id!r} is already in flight on this worker")
        if self.num_queued() >= self.options.max_waiting:
            raise ResourceExhausted(f"{self.options.role} worker {self.worker_id}: "
                                    f"{self.options.max_waiting} requests already queued")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.streams[request_id] = queue
        self.max_num_queued = max(self.max_num_queued, self.num_queued())
        return queue

    def hand_back_streams(self) -> int:
        """Drain deadline: end every stream that reads engine outputs with UNAVAILABLE (the
        gateway migrates or retries it; the stream's handler frees its blocks)."""
        self.handed_back = True
        for rid, queue in self.streams.items():
            queue.put_nowait(RequestOutput(rid, [], None, error="the worker is draining"))
        return len(self.streams)

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

    def request_loads(self) -> list[worker_pb2.RequestLoad]:
        """Every request this worker holds (a stream, or blocks in the engine) and its stage
        (see ``WorkerLoad.requests`` in worker.proto). Plain reads from the event loop thread:
        the engine's request table is copied at once (``dict()`` holds the GIL throughout)."""
        engine_requests = dict(self.engine.scheduler.requests)
        out = []
        for rid in self.streams.keys() | engine_requests.keys():
            req = engine_requests.get(rid)
            out.append(worker_pb2.RequestLoad(
                request_id=rid, stage=request_stage(req, rid in self.streams),
                num_prompt_tokens=req.num_prompt_tokens if req else 0,
                num_computed_tokens=req.num_computed_tokens if req else 0,
                num_kv_blocks=len(req.block_table) if req else 0,
                num_preemptions=req.num_preemptions if req else 0))
        return out

    # shared RPC handler (each role has its own Abort: freeing must wait for KV writes)
    async def GetLoad(self, request, context) -> worker_pb2.WorkerLoad:
        closed = self.reservations.closed.items() if self.reservations is not None else ()
        return worker_pb2.WorkerLoad(
            worker_id=self.worker_id, role=self.options.role, **self.engine.load(),
            requests=self.request_loads(), max_num_queued=self.max_num_queued,
            max_used_kv_blocks=self.engine.block_manager.max_used_blocks,
            closed_reservations=[worker_pb2.ClosedReservation(
                request_id=rid, outcome=o.kind, reason=str(o.note.get("reason", "")))
                for rid, o in closed])


def request_stage(req: Request | None, streamed: bool) -> str:
    """A held request's stage: ``req`` is the engine's request (None: not added yet),
    ``streamed`` whether an RPC stream still waits on it."""
    if req is None or req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
        return "queued"
    if req.status == RequestStatus.WAITING_FOR_KV:
        return "waiting_for_kv" if streamed else "quarantined"
    if req.is_finished():
        return "transferring"  # prefill role: KV held until it has been written
    return "prefilling" if req.num_computed_tokens < req.num_prompt_tokens else "decoding"
