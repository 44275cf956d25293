"""Graceful drain: what a service does between SIGTERM and its exit, so that a Kubernetes rolling
update (SIGTERM, then SIGKILL after ``terminationGracePeriodSeconds``) loses no client stream.

Worker (``drain_worker``), in this order:

1. health NOT_SERVING (readiness fails) and ``WorkerRuntime.draining``: every new Decode,
   Prefill or reservation is refused with UNAVAILABLE, which the gateway treats as "worker
   lost": it routes the request to another worker (a refused Prefill first tells the decode
   worker that its reservation will not be written, so no block waits for the lease);
2. leave the registry: the gateway reads it on every routing decision, so it stops picking
   this worker at once;
3. let what runs finish, until the role's drain deadline (``worker.decode_drain_s`` /
   ``worker.prefill_drain_s``);
4. at the deadline (or at a second SIGTERM/SIGINT), hand back what is left (``hand_back``): a
   decode worker ends each stream with UNAVAILABLE, the signal on which the gateway migrates it
   (prompt + tokens so far, to another decode worker; the client stream continues and greedy
   output equals an uninterrupted run); a prefill worker cancels its handoffs (each tells its
   decode worker "not written" once no write is in flight) and answers UNAVAILABLE, so the
   gateway retries the prompt on another prefill worker;
5. wait, at most ``kv_lease_s`` more, until no block is held: streams released, quarantined
   reservations closed (a prefill worker's write may still be landing), and log the count.

So a worker exits by ``drain_s + kv_lease_s`` (+ the gRPC server's stop), which the manifests'
grace periods must exceed (``tests/unit/test_k8s_drain.py`` checks ``k8s/``).

Gateway (``drain_gateway``): readiness fails (gRPC health NOT_SERVING, ``/ready`` 503), new
requests get UNAVAILABLE / HTTP 503 (the Service routes them to another replica once the
endpoint is gone), open streams finish until ``gateway.drain_s``; the rest are cancelled.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a drain looks at what is still held
STOP_GRACE_S = 5.0  # gRPC server stop after the drain: lets the last error statuses out


class Signals:
    """SIGINT and SIGTERM on the running loop: ``received`` is set by the first, ``again`` by
    any later one (an operator in a hurry: the drain hands back what runs at once)."""

    def __init__(self) -> None:
        self.received = asyncio.Event()
        self.again = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.received.is_set():
            log.warning("%s again during the drain: handing back what still runs", sig.name)
            self.again.set()
        else:
            log.info("%s: draining", sig.name)
            self.received.set()


async def wait_for(cond: Callable[[], bool], timeout_s: float,
                   hurry: asyncio.Event | None = None) -> bool:
    """Poll ``cond()`` every ``POLL_S`` until it holds (True), or ``timeout_s`` seconds pass or
    ``hurry`` is set (False)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() >= deadline or (hurry is not None and hurry.is_set()):
            return False
        await asyncio.sleep(min(POLL_S, max(0.0, deadline - loop.time())))
    return True


class Drainable(Protocol):
    """A worker's servicer, as the drain sees it."""

    def busy(self) -> bool:
        """Whether it still holds a request (a handoff, an open reservation)."""

    def hand_back(self) -> int:
        """End every request it holds so that the gateway retries or migrates it elsewhere;
        returns how many."""


async def drain_worker(runtime, servicer: Drainable, drain_s: float,
                       hurry: asyncio.Event | None = None) -> int:
    """Steps 3-5 above for a worker whose health is NOT_SERVING, that refuses new requests
    (``runtime.draining``) and has left the registry. ``runtime`` is its ``WorkerRuntime``;
    ``drain_s`` seconds for running requests to finish. Returns the KV blocks still in use at
    the end (0 unless a quarantined reservation outlived ``kv_lease_s``)."""
    role, worker_id = runtime.options.role, runtime.worker_id
    held = len(runtime.streams)
    log.info("%s worker %s draining: %d requests held, deadline %.1fs", role, worker_id, held,
             drain_s)

    def idle() -> bool:
        return not runtime.streams and not servicer.busy()

    if not await wait_for(idle, drain_s, hurry):
        n = servicer.hand_back()
        log.warning("%s worker %s: drain deadline reached with %d requests running: handed "
                    "back for %s elsewhere", role, worker_id, n,
                    "retry" if role == "prefill" else "migration")
    bm = runtime.engine.block_manager
    await wait_for(lambda: idle() and bm.num_used_blocks == 0,
                   runtime.options.kv_lease_s + 2 * POLL_S)
    used = bm.num_used_blocks
    (log.info if used == 0 else log.warning)(
        "%s worker %s drained: %d KV blocks in use, %d requests held", role, worker_id, used,
        len(runtime.streams))
    return used


async def drain_gateway(readiness, core, drain_s: float, hurry: asyncio.Event | None = None) -> int:
    """Fail readiness (``ReadinessMonitor.drain``), refuse new requests (``core.draining``)
    and wait until no request is in flight or ``drain_s`` seconds pass (or ``hurry``).
    Returns the requests still in flight (cancelled by the server's stop that follows)."""
    core.draining = True
    await readiness.drain()
    log.info("gateway draining: %d requests in flight, deadline %.1fs", core.num_inflight, drain_s)
    if not await wait_for(lambda: core.num_inflight == 0, drain_s, hurry):
        log.warning("gateway drain deadline reached: cancelling %d open streams", core.num_inflight)
    else:
        log.info("gateway drained: no request in flight")
    return core.num_inflight
