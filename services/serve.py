"""Process entry points: run one gateway, prefill worker or decode worker until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import torch

from services.api import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.loader import load_config
from services.engine.model_files import DEFAULT_MODEL_NAME, default_model_path
from services.engine.tokenizer import Tokenizer
from services.rpc import bind, create_server, mark_not_serving, mark_serving
from services.state.redis_server import check_redis
from services.state.registry import WorkerRegistry
from services.state.store import RequestStateStore
from services.worker import WorkerOptions, WorkerRuntime, redis_client

log = logging.getLogger(__name__)


def served_model_name(model: str) -> str:
    """The name clients use: the default model's, else the file stem or directory name."""
    path = Path(model)
    return DEFAULT_MODEL_NAME if path == default_model_path() else path.stem


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


EXIT_ENGINE_DIED = 3  # a worker's exit status when its engine died (a supervisor restarts it)


def role_engine_config(opts: WorkerOptions) -> EngineConfig:
    """The engine config with the role's defaults filled in: a prefill worker caps a long
    prompt's chunk at a quarter of the token budget while others wait, so a short prompt queued
    behind it is not held until its last chunk (``long_prefill_token_threshold``)."""
    cfg = opts.engine
    if cfg.long_prefill_token_threshold is not None or opts.role != "prefill":
        return cfg
    return cfg.model_copy(update={"long_prefill_token_threshold":
                                  max(1, cfg.max_num_batched_tokens // 4)})


async def serve_worker(opts: WorkerOptions, num_threads: int) -> None:
    """Load the model, start the engine thread and the gRPC server, heartbeat until signalled.

    Health is NOT_SERVING until the engine is loaded, warmed up and heartbeating, and again
    from the moment the engine dies; then the worker leaves the registry, stops, and raises
    ``SystemExit(EXIT_ENGINE_DIED)``."""
    from services.decode.server import DecodeServicer
    from services.prefill.server import PrefillServicer

    torch.set_num_threads(num_threads)
    await check_redis(opts.redis_url)
    engine = await asyncio.to_thread(LLMEngine, role_engine_config(opts),
                                     fault_injection=opts.fault_injection)
    log.info("%s engine warmed up in %.2fs", opts.role, await asyncio.to_thread(engine.warm_up))
    runtime = WorkerRuntime(opts, engine)
    if opts.role == "decode":
        servicer, add, name = DecodeServicer(runtime), worker_pb2_grpc.add_DecodeWorkerServicer_to_server, "DecodeWorker"
    else:
        servicer, add, name = PrefillServicer(runtime), worker_pb2_grpc.add_PrefillWorkerServicer_to_server, "PrefillWorker"
    full_name = worker_pb2.DESCRIPTOR.services_by_name[name].full_name
    server, health = create_server([full_name])
    await mark_not_serving(health, [full_name])
    add(servicer, server)
    port = bind(server, opts.host, opts.port)
    await server.start()
    runtime.start(f"{opts.advertise_host}:{port}")
    await mark_serving(health, [full_name])
    log.info("%s worker %s ready on %s:%d", opts.role, runtime.worker_id, opts.host, port)
    try:
        await _wait_for_signal_or(runtime.died)
    finally:
        await health.enter_graceful_shutdown()  # NOT_SERVING for every service
        await runtime.heartbeater.stop()  # leave the registry first: no new requests
        await server.stop(grace=5.0)
        servicer.close()
        await runtime.stop()
    if runtime.died.is_set():
        log.critical("%s worker %s exits: its engine died", opts.role, runtime.worker_id)
        raise SystemExit(EXIT_ENGINE_DIED)


async def _wait_for_signal_or(event: asyncio.Event) -> None:
    signalled = asyncio.ensure_future(_wait_for_signal())
    died = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({signalled, died}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        signalled.cancel()
        died.cancel()


async def serve_gateway(host: str, port: int, redis_url: str, model: str, rpc_timeout_s: float,
                        heartbeat_s: float, kv_failure_policy: str = "recompute",
                        max_inflight: int = 1024) -> None:
    """Run the public Gateway service until signalled."""
    from services.gateway.routing import WorkerPool
    from services.gateway.server import GatewayServicer

    await check_redis(redis_url)
    tokenizer = Tokenizer.load(model)
    config = load_config(model)
    redis = redis_client(redis_url)
    pool = WorkerPool(WorkerRegistry(redis, heartbeat_s), heartbeat_s, rpc_timeout_s)
    servicer = GatewayServicer(
        tokenizer, served_model_name(model), config.max_position_embeddings,
        RequestStateStore(redis), pool, rpc_timeout_s, kv_failure_policy, max_inflight)
    full_name = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
    server, health = create_server([full_name])
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    bound = bind(server, host, port)
    await server.start()
    await mark_serving(health, [full_name])
    log.info("gateway listening on %s:%d (model %s, kv failure policy %s, max %d in flight)",
             host, bound, served_model_name(model), kv_failure_policy, max_inflight)
    try:
        await _wait_for_signal()
    finally:
        await health.enter_graceful_shutdown()
        await server.stop(grace=5.0)
        await servicer.close()
        await redis.aclose()
