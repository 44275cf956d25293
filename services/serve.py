"""Process entry points: run one gateway, prefill worker or decode worker until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from typing import TYPE_CHECKING

from services.api import worker_pb2, worker_pb2_grpc
from services.auth import read_internal_secret, warn_if_open
from services.gateway.model_card import served_model_name  # noqa: F401  (its old home)
from services.rpc import bind, create_server, mark_serving
from services.state.redis_server import check_redis

if TYPE_CHECKING:
    from services.gateway.app import GatewayOptions
    from services.worker import WorkerOptions

log = logging.getLogger(__name__)


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve_worker(opts: WorkerOptions, num_threads: int) -> None:
    """Load the model, start the engine thread and the gRPC server, heartbeat until signalled."""
    import torch  # NOTE: here, not at the top: the gateway process must not load torch

    from services.decode.server import DecodeServicer
    from services.engine.engine import LLMEngine
    from services.prefill.server import PrefillServicer
    from services.worker import WorkerRuntime

    torch.set_num_threads(num_threads)
    if opts.internal_secret is None:
        opts = dataclasses.replace(opts, internal_secret=read_internal_secret())
    warn_if_open(opts.internal_secret, f"{opts.role} worker")
    await check_redis(opts.redis_url)
    engine = await asyncio.to_thread(LLMEngine, opts.engine)
    log.info("%s engine warmed up in %.2fs", opts.role, await asyncio.to_thread(engine.warm_up))
    runtime = WorkerRuntime(opts, engine)
    if opts.role == "decode":
        servicer, add, name = DecodeServicer(runtime), worker_pb2_grpc.add_DecodeWorkerServicer_to_server, "DecodeWorker"
    else:
        servicer, add, name = PrefillServicer(runtime), worker_pb2_grpc.add_PrefillWorkerServicer_to_server, "PrefillWorker"
    full_name = worker_pb2.DESCRIPTOR.services_by_name[name].full_name
    server, health = create_server([full_name], opts.internal_secret)
    add(servicer, server)
    port = bind(server, opts.host, opts.port)
    await server.start()
    runtime.start(f"{opts.advertise_host}:{port}")
    await mark_serving(health, [full_name])
    log.info("%s worker %s ready on %s:%d", opts.role, runtime.worker_id, opts.host, port)
    try:
        await _wait_for_signal()
    finally:
        await health.enter_graceful_shutdown()
        await runtime.heartbeater.stop()  # leave the registry first: no new requests
        await server.stop(grace=5.0)
        servicer.close()
        await runtime.stop()


async def serve_gateway(opts: GatewayOptions) -> None:
    """Run the public Gateway (``services.gateway.app``) until signalled. With no
    ``opts.internal_secret``, the one from ``services.auth.read_internal_secret`` (if any) is
    sent on every call to a worker."""
    from services.gateway.app import run_gateway

    if opts.internal_secret is None:
        opts = dataclasses.replace(opts, internal_secret=read_internal_secret())
    warn_if_open(opts.internal_secret, "gateway")
    await run_gateway(opts, _wait_for_signal())
