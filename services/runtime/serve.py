"""Process entry points: run one gateway, prefill, decode or unified worker until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from services.api import worker_pb2, worker_pb2_grpc
from services.auth import warn_if_open
from services.runtime.drain import STOP_GRACE_S, Signals, drain_worker
from services.rpc import bind, create_server, mark_not_serving, mark_serving
from services.startup_heap import freeze_startup_heap
from services.state.redis_server import check_redis

if TYPE_CHECKING:
    from services.engine.engine import EngineConfig
    from services.gateway.app import GatewayOptions
    from services.runtime.worker import WorkerOptions

log = logging.getLogger(__name__)


EXIT_ENGINE_DIED = 3  # a worker's exit status when its engine died (a supervisor restarts it)
EXIT_LISTENER_LOST = 4  # ... when its gRPC port stopped accepting connections (likewise)
LISTENER_PROBES = 3  # refused connections in a row, one a heartbeat, that mean the port is lost


def role_engine_config(opts: WorkerOptions) -> EngineConfig:
    """The engine config with the role's defaults filled in: a prefill worker caps a long
    prompt's chunk at a quarter of the token budget while others wait, so a short prompt queued
    behind it is not held until its last chunk (``long_prefill_token_threshold``)."""
    cfg = opts.engine
    if cfg.long_prefill_token_threshold is not None or opts.role != "prefill":
        return cfg
    return cfg.model_copy(update={"long_prefill_token_threshold":
                                  max(1, cfg.max_num_batched_tokens // 4)})


def _servicer(runtime):
    """(servicer, add-to-server function, gRPC service name) of the runtime's role."""
    if runtime.options.role in ("decode", "unified"):  # unified: DecodeWorker, prefilling locally
        from services.decode.server import DecodeServicer
        from services.unified.server import UnifiedServicer

        cls = UnifiedServicer if runtime.options.role == "unified" else DecodeServicer
        return cls(runtime), worker_pb2_grpc.add_DecodeWorkerServicer_to_server, "DecodeWorker"
    from services.prefill.server import PrefillServicer

    return PrefillServicer(runtime), worker_pb2_grpc.add_PrefillWorkerServicer_to_server, "PrefillWorker"


async def serve_worker(opts: WorkerOptions, num_threads: int) -> None:
    """Load the model, start the engine thread and the gRPC server, heartbeat until signalled,
    then drain (``services/runtime/drain.py``: NOT_SERVING, refuse new requests, leave the registry,
    finish or hand back what runs by ``opts.drain_s``) and return (exit 0).

    Health is NOT_SERVING until the engine is loaded, warmed up and heartbeating, and again
    from the moment the engine dies; then the worker leaves the registry, stops, and raises
    ``SystemExit(EXIT_ENGINE_DIED)``. A worker whose own gRPC port stops accepting
    connections (``watch_listener``) drains as if signalled, then raises
    ``SystemExit(EXIT_LISTENER_LOST)``: a supervisor restarts it."""
    import torch  # NOTE: here, not at the top: the gateway process must not load torch

    from services.gateway.model_card import served_model_name
    from services.observability.metrics import MetricsServer, WorkerMetrics
    from services.runtime.worker import WorkerRuntime

    torch.set_num_threads(_within_cpu_budget(num_threads))
    warn_if_open(opts.internal_secret, f"{opts.role} worker")
    await check_redis(opts.redis_url)
    engine, warm_up_s = await on_passing_thread(_load_engine, opts)
    log.info("%s engine warmed up in %.2fs", opts.role, warm_up_s)
    runtime = WorkerRuntime(opts, engine)
    runtime.metrics = WorkerMetrics(served_model_name(opts.engine.model), opts.role,
                                    runtime.worker_id, engine, lambda: runtime.reservations,
                                    lambda: runtime)
    metrics = MetricsServer(runtime.metrics.registry, opts.host, opts.metrics_port)
    servicer, add, name = _servicer(runtime)
    full_name = worker_pb2.DESCRIPTOR.services_by_name[name].full_name
    server, health, port = await _start_server(opts, full_name, lambda s: add(servicer, s))
    runtime.start(f"{opts.advertise_host}:{port}", served_model_name(opts.engine.model))
    freeze_startup_heap(f"{opts.role} worker {runtime.worker_id}")
    await mark_serving(health, [full_name])
    log.info("%s worker %s ready on %s:%d (Prometheus metrics on http://%s:%d/metrics)",
             opts.role, runtime.worker_id, opts.host, port, opts.host, metrics.port)
    signals = Signals()
    listener_lost = asyncio.ensure_future(watch_listener(
        opts.host, port, opts.heartbeat_s, what=f"{opts.role} worker {runtime.worker_id}"))
    try:
        await _first_of(signals.received.wait(), runtime.died.wait(), listener_lost)
        await health.enter_graceful_shutdown()  # NOT_SERVING for every service
        runtime.draining = True  # new requests: UNAVAILABLE (the gateway goes elsewhere)
        await runtime.heartbeater.stop()  # leave the registry: the gateway stops routing here
        await runtime.stop_kv_events()  # "cleared": gateways forget this cache at once
        if not runtime.died.is_set():
            await drain_worker(runtime, servicer, opts.drain_s, signals.again)
    finally:
        listener_lost.cancel()
        await health.enter_graceful_shutdown()
        await runtime.heartbeater.stop()
        servicer.stopping()  # long-lived streams end, so the grace below waits only for the rest
        await server.stop(grace=STOP_GRACE_S)
        servicer.close()
        await asyncio.to_thread(metrics.close)
        await runtime.stop()
    if runtime.died.is_set():
        log.critical("%s worker %s exits: its engine died", opts.role, runtime.worker_id)
        raise SystemExit(EXIT_ENGINE_DIED)
    if listener_lost.done() and not listener_lost.cancelled():
        raise SystemExit(EXIT_LISTENER_LOST)


async def _start_server(opts: WorkerOptions, full_name: str, add) -> tuple[Any, Any, int]:
    """The worker's gRPC server (``add`` puts its servicer on it), listening and NOT_SERVING
    until the caller marks it: (server, health servicer, bound port)."""
    server, health = create_server([full_name], opts.internal_secret)
    await mark_not_serving(health, [full_name])
    add(server)
    port = bind(server, opts.host, opts.port,
                opts.internal_tls.server_credentials() if opts.internal_tls else None)
    await server.start()
    return server, health, port


async def watch_listener(host: str, port: int, interval_s: float,
                         probes: int = LISTENER_PROBES, what: str = "worker") -> None:
    """Return once ``host:port`` (a wildcard host: on loopback) has refused ``probes`` TCP
    connections in a row, trying every ``interval_s`` seconds, and log it as ``what``'s;
    run forever while it accepts.

    Why a worker watches its own port: a port can stop taking connections while the process
    goes on. The machine may refuse some ports whatever listens on them (the project's CI
    machines refuse five loopback ports of the ephemeral range, which ``services.ports`` now
    keeps our own picks out of, but a configured port may be one), or gRPC may close the server's acceptor after an accept4() error it does not expect ("Closing
    acceptor. Failed accept4" in its log). Heartbeats would keep such a worker in the registry:
    the gateway routes to it, fails, marks it suspect, and tries again a few heartbeats later,
    for good. Exiting lets a supervisor restart it on another port."""
    from services.runtime.process import refuses_connections

    refused, probe_host = 0, _loopback_if_wildcard(host)
    while refused < probes:
        await asyncio.sleep(interval_s)
        refused = refused + 1 if await refuses_connections(probe_host, port) else 0
    log.critical("%s: its gRPC port %s:%d refuses connections (%d probes in a row): leaving the "
                 "registry, finishing what runs on open connections, then exiting with %d",
                 what, host, port, probes, EXIT_LISTENER_LOST)


def _loopback_if_wildcard(host: str) -> str:
    """Where this machine reaches a server listening on ``host``."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _within_cpu_budget(num_threads: int) -> int:
    """``num_threads`` capped by the CPUs this process may use (affinity and cgroup quota,
    ``engine.cpus``): a team larger than that stalls at every join. Warns when it caps."""
    from services.engine.cpus import available_cpus

    budget = available_cpus()
    if num_threads > budget:
        log.warning("worker.num_threads %d exceeds the %d CPU(s) this process may use (affinity "
                    "and cgroup quota): using %d", num_threads, budget, budget)
    return min(num_threads, budget)


def _load_engine(opts: WorkerOptions):
    """``(engine, warm-up seconds)``: the role's engine, loaded and warmed up."""
    if opts.engine.device == "cpu":
        from kernels import cpu_kernels

        cpu_kernels.log_loaded()  # which build each C kernel uses; a WARNING if one is missing
    from services.engine.engine import LLMEngine

    engine = LLMEngine(role_engine_config(opts), fault_injection=opts.fault_injection,
                       kv_events=opts.publish_kv_events)
    return engine, engine.warm_up()


async def on_passing_thread(fn, *args):
    """``fn(*args)`` on a thread of its own that has ended when this returns.

    Why not ``asyncio.to_thread``: an OpenMP thread team belongs to the thread that started it
    and lives as long as that thread. Loading and warming up start one (torch's and our
    kernels' parallel regions); on an executor thread it would idle there for good, and once a
    process holds more OpenMP threads than CPUs, libgomp cuts every barrier's spin to 1,000
    iterations (its "throttled" spin count) and puts waiting threads to sleep. Every decode step
    on the engine thread then paid ~150 futex sleeps and wake-ups: 24-28 ms a step on 2 threads
    of the 2-core machine instead of 9 (2026-11-23 20:00; the sitting is in git:
    ``git show d03592e:docs/benchmarks.md``)."""
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-load") as once:
        return await loop.run_in_executor(once, functools.partial(fn, *args))


async def _first_of(*awaitables) -> None:
    """Wait until one of ``awaitables`` is done; cancel the others (a future passed in is
    left as it is, for the caller to ask which one ended)."""
    futures = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for f, a in zip(futures, awaitables):
            if f is not a:
                f.cancel()


async def serve_gateway(opts: GatewayOptions) -> None:
    """Run the public Gateway (``services.gateway.app``) until signalled, then drain it
    (``services.runtime.drain.drain_gateway``; a second signal cuts the drain short).
    ``opts.internal_secret`` (if any) is sent on every call to a worker."""
    from services.gateway.app import run_gateway

    warn_if_open(opts.internal_secret, "gateway")
    signals = Signals()
    await run_gateway(opts, signals.received.wait(), signals.again,
                      on_ready=lambda: freeze_startup_heap("gateway"))
