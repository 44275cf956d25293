"""Prefill worker: batches prompts (chunked prefill under a token budget), computes each
prompt's KV and first token, writes the KV into the decode worker's reserved blocks with a
notification carrying the first token, then frees its own blocks.

Every handoff ends with exactly one notification to the decode worker: "landed" (the write
succeeded) or "not_written" (an empty write, sent only after any write into the reservation
has ended: cancelled, failed, or the lease too short). A write never runs past the
reservation's lease, and this worker's own blocks are freed only once no write reads them.
While the prompt waits and computes, the worker renews the destination's lease (every third of
it, with the reservation's write token), so a prompt that outlives one lease is not computed
again by the decode worker; if the decode worker stops answering, the lease it last granted
stands.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

from services.api import worker_pb2, worker_pb2_grpc
from services.engine import commands
from services.kv_transfer import KVLeaseRefusedError, KVTransferError
from services.observability import tracing
from services.observability.logs import bind_request
from services.prefill.faults import Faults
from services.errors import Aborted, InvalidArgument, Unavailable
from services.api.convert import params_from_proto, prompt_logprobs_to_proto
from services.runtime.worker import WorkerRuntime

log = logging.getLogger(__name__)

NOTE_TIMEOUT_S = 5.0  # telling a decode worker that its reservation will not be written


def lease_margin_s(lease_s: float) -> float:
    """Seconds before the lease's end by which every write must be over: covers the transit of
    the Prefill request and of a write's last bytes (the lease is measured from the gateway)."""
    return min(1.0, 0.2 * lease_s)


class _Lease:
    """The destination's lease as this worker sees it: ``deadline`` (``time.monotonic()``) by
    which every write into the reservation must be over; renewals push it later."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s  # the lease last granted, seconds
        self.deadline = time.monotonic() + lease_s - lease_margin_s(lease_s)
        self.refused = asyncio.Event()  # the destination refused a renewal: it wants no KV

    def renewed(self, sent_at: float, lease_s: float) -> None:
        """The destination granted ``lease_s`` seconds to a renewal sent at ``sent_at``."""
        self.lease_s = lease_s
        self.deadline = max(self.deadline, sent_at + lease_s - lease_margin_s(lease_s))


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime
        # a sender only: its listener is never written to, but costs nothing
        self.transport = runtime.create_transport(port=0)
        self.transfer_timeout_s = runtime.options.kv_transfer_timeout_s
        self._handoffs: dict[str, asyncio.Task] = {}
        self.GetLoad = runtime.GetLoad

    def close(self) -> None:
        self.transport.close()

    def stopping(self) -> None:
        """The gRPC server stops next: nothing to end (Prefill calls are not long-lived)."""

    def busy(self) -> bool:
        """Whether a handoff is still running (computing, or writing KV)."""
        return bool(self._handoffs)

    def hand_back(self) -> int:
        """Drain deadline (services/runtime/drain.py): every prompt still queued or computing ends with
        UNAVAILABLE (after telling its decode worker "not written"), so the gateway retries it
        on another prefill worker; a write already under way finishes by its deadline."""
        return self.rt.hand_back_streams()

    async def Prefill(self, request: worker_pb2.PrefillRequest, context):
        rid, dest = request.request_id, request.destination
        if dest.transport != self.rt.options.kv_transport:
            raise InvalidArgument("destination.transport", f"{dest.transport!r}, this worker sends "
                                  f"with {self.rt.options.kv_transport!r}")
        if rid in self._handoffs:
            raise InvalidArgument("request_id", f"{rid!r} is already in flight on this worker")
        if self.rt.draining:  # the decode worker frees the reservation now, not at its lease's end
            why = f"prefill worker {self.rt.worker_id} is draining (shutting down)"
            await self._send_not_written(dest, rid, why)
            raise Unavailable(f"{why}: use another prefill worker")
        trace = tracing.worker_trace("prefill", context, rid, len(request.prompt_token_ids))
        bind_request(rid, trace)
        task = asyncio.create_task(self._handoff(request, _Lease(dest.lease_s), trace))
        task.add_done_callback(trace.end_prefill)
        self._handoffs[rid] = task
        task.add_done_callback(lambda t: (self._handoffs.pop(rid, None),
                                          t.cancelled() or t.exception()))  # retrieved: no warning
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the gateway went away: wind down safely
                task.cancel()
                raise
            raise Aborted(f"request {rid} was aborted") from None  # by Abort, before it ran

    async def Abort(self, request: worker_pb2.WorkerAbortRequest, context):
        task = self._handoffs.get(request.request_id)
        if task is not None:
            task.cancel()
        return worker_pb2.WorkerAbortResponse(found=task is not None)

    async def _handoff(self, request: worker_pb2.PrefillRequest, lease: _Lease,
                       trace=tracing.NO_TRACE) -> worker_pb2.PrefillResponse:
        """Compute the prompt (renewing the ``lease`` meanwhile), write its KV before the lease
        ends, answer; on any failure tell the destination that nothing will be written, once no
        write is in flight. The write is ``trace``'s ``kv_transfer`` span."""
        rid, dest = request.request_id, request.destination
        faults = Faults.parse(rid, self.rt.options.fault_injection)
        # the prefill worker samples only the first token; the decode worker decides stopping
        params = params_from_proto(request.sampling_params).model_copy(update={"max_tokens": 1})
        t_arrival = time.monotonic()
        queue = self.rt.open_stream(rid)  # RESOURCE_EXHAUSTED here: the reservation is untouched
        held, write = False, None
        keeper = asyncio.ensure_future(self._keep_lease(dest, lease))
        try:
            prompt = list(request.prompt_token_ids)
            first, n_blocks = self._blocks_to_write(len(prompt), dest)
            await asyncio.sleep(faults.queue_delay_s)
            held = True  # set first: cancelled once added, it is freed; refused, nothing is found
            req = await self.rt.call(commands.AddRequest(rid, prompt, params, hold_kv=True))
            out = await _first_output(queue, lease)
            keeper.cancel()  # NOTE: a grant being written is not renewed; the write ends in time
            self.rt.check_output(out)  # failed alone, or the engine died: an error
            t_first = time.monotonic()
            note = json.dumps({"request_id": rid, "status": "landed",
                               "first_token_id": out.new_token_ids[0],
                               "logprobs": out.logprobs[0].to_dict() if out.logprobs else None})
            write = asyncio.ensure_future(asyncio.to_thread(
                self._write, dest, req.block_table[first:first + n_blocks], note.encode(),
                lease.deadline, faults))
            t_done, _ = landed = await asyncio.shield(write)
            self._landed(trace, dest, t_first, landed, n_blocks)
        except BaseException as exc:
            keeper.cancel()
            if write is not None:
                await _wait_out(write)
                if _failed(write):
                    trace.kv_transfer(t_first, time.monotonic(), n_blocks, 0, dest.transport,
                                      "failed", _reason(exc, write))
                else:  # landed, then the gateway stopped waiting (the stream had ended)
                    self._landed(trace, dest, t_first, write.result(), n_blocks)
            self._count_transfer(0.0, 0, _failure_kind(exc, write))
            if write is None or _failed(write):
                await self._send_not_written(dest, rid, _reason(exc, write))
            if isinstance(exc, (ValueError, Aborted, Unavailable)):
                raise  # argument errors keep their status; ABORTED already; UNAVAILABLE: retry
            raise Aborted(f"prefill worker: {_reason(exc, write)}") from exc
        finally:
            self.rt.streams.pop(rid, None)
            if held:  # finished (blocks held for the transfer) or still running: free either way
                self.rt.release(rid)
        return worker_pb2.PrefillResponse(
            worker_id=self.rt.worker_id, first_token_id=out.new_token_ids[0],
            queue_time_s=req.first_scheduled_time - t_arrival,
            compute_time_s=t_first - req.first_scheduled_time, transfer_time_s=t_done - t_first,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt_logprobs=prompt_logprobs_to_proto(out.prompt_logprobs))

    def _blocks_to_write(self, num_tokens: int, dest: worker_pb2.KVReservation) -> tuple[int, int]:
        """(first, count) of the prompt's blocks to write: those after the prefix the
        destination holds already and the blocks before its sliding window it skips. Raises
        ValueError naming ``destination.block_ids`` when they are not exactly as many as its
        block ids (or none)."""
        first = dest.num_cached_blocks + dest.num_skipped_blocks
        n_blocks = self.rt.engine.block_manager.blocks_needed(num_tokens) - first
        if n_blocks < 1 or len(dest.block_ids) != n_blocks:
            raise InvalidArgument("destination.block_ids", f"{len(dest.block_ids)} blocks for "
                                  f"{num_tokens} prompt tokens after {first} cached or skipped "
                                  f"blocks, expected {max(n_blocks, 1)}")
        if dest.num_partial_blocks >= n_blocks:
            raise InvalidArgument("destination.num_partial_blocks",
                                  f"{dest.num_partial_blocks} of {n_blocks} blocks: the last "
                                  "block is always written whole")
        return first, n_blocks

    def _layer_starts(self, dest: worker_pb2.KVReservation) -> list[int] | None:
        """Per layer, the first of the write's blocks it sends: the destination's
        ``num_partial_blocks`` for a sliding layer (those before are outside its window), 0
        for a global one; None when every layer sends every block."""
        if not dest.num_partial_blocks:
            return None
        config = self.rt.engine.model_config
        return [0 if config.layer_window(layer) is None else dest.num_partial_blocks
                for layer in range(config.num_hidden_layers)]

    def _landed(self, trace, dest: worker_pb2.KVReservation, t_first: float,
                landed: tuple[float, int], n_blocks: int) -> None:
        """A handoff's KV landed (``landed``: when, ``time.monotonic()``, and its payload
        bytes): its span and metrics."""
        t_done, nbytes = landed
        trace.kv_transfer(t_first, t_done, n_blocks, nbytes, dest.transport, "landed")
        self._count_transfer(t_done - t_first, nbytes, None)

    def _count_transfer(self, seconds: float, nbytes: int, failure: str | None) -> None:
        """Metrics of one handoff: its write's duration and payload bytes, or why it did not
        land."""
        if self.rt.metrics is None:
            return
        if failure is not None:
            self.rt.metrics.kv_transfer_failures[failure].inc()
        elif nbytes:
            self.rt.metrics.transferred(seconds, nbytes)

    def _write(self, dest: worker_pb2.KVReservation, local_ids: list[int], note: bytes,
               deadline: float, faults: Faults) -> tuple[float, int]:
        """Transfer thread: write the KV into the reservation, ending by ``deadline``; returns
        when it landed (``time.monotonic()``) and the payload bytes. Raises KVTransferError
        (nothing or part written; the caller reports it)."""
        time.sleep(faults.kv_write_delay_s)
        if faults.fail_kv_write:
            raise KVTransferError("injected fault: fail_kv_write")
        peer = self.transport.add_remote(dest.transport_metadata)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise KVTransferError("the reservation's lease ends before the KV could be written")
        nbytes = self.transport.write_blocks(peer, local_ids, list(dest.block_ids), note,
                                             min(self.transfer_timeout_s, remaining),
                                             token=dest.write_token,
                                             layer_starts=self._layer_starts(dest))
        return time.monotonic(), nbytes

    async def _keep_lease(self, dest: worker_pb2.KVReservation, lease: _Lease) -> None:
        """Renew the destination's lease every third of it until cancelled (the write starts,
        or the handoff ends). A refused renewal stops renewing (the decode worker wants the KV
        no more); a failed one (timeout, dropped connection: a busy peer) is tried again every
        tenth of the lease while the lease last granted lasts, so one slow answer does not end
        the lease. Without renewals the handoff gives up by its deadline."""
        try:
            peer = await asyncio.to_thread(self.transport.add_remote, dest.transport_metadata)
        except (KVTransferError, OSError, ValueError) as exc:
            log.info("lease on decode worker %s not renewed: %s", dest.worker_id, exc)
            return
        delay = lease.lease_s / 3
        while True:
            await asyncio.sleep(delay)
            sent_at = time.monotonic()
            try:
                lease.renewed(sent_at, await asyncio.to_thread(
                    self.transport.renew_lease, peer, dest.write_token,
                    min(lease.lease_s / 3, NOTE_TIMEOUT_S)))
                delay = lease.lease_s / 3
            except KVLeaseRefusedError as exc:
                log.info("decode worker %s wants the KV no more: %s", dest.worker_id, exc)
                lease.refused.set()
                return
            except (KVTransferError, OSError) as exc:
                if time.monotonic() >= lease.deadline:
                    log.info("lease on decode worker %s not renewed: %s", dest.worker_id, exc)
                    return
                log.info("lease renewal on decode worker %s failed (%s): trying again while "
                         "the lease lasts", dest.worker_id, exc)
                delay = lease.lease_s / 10

    async def _send_not_written(self, dest: worker_pb2.KVReservation, rid: str, reason: str) -> None:
        """Close the reservation early with an empty write; if the destination cannot be told,
        its lease frees the blocks."""
        note = json.dumps({"request_id": rid, "status": "not_written", "reason": reason}).encode()

        def send() -> None:
            peer = self.transport.add_remote(dest.transport_metadata)
            self.transport.write_blocks(peer, [], [], note, NOTE_TIMEOUT_S, token=dest.write_token)

        try:
            await asyncio.wait_for(asyncio.to_thread(send), 2 * NOTE_TIMEOUT_S)
        except (KVTransferError, ValueError, OSError, TimeoutError) as exc:
            log.info("request %s: could not tell decode worker %s that its KV will not come "
                     "(%s); the reservation's lease frees it", rid, dest.worker_id, exc)


async def _first_output(queue: asyncio.Queue, lease: _Lease):
    """The request's first output (its first token), awaited until the lease's deadline, which
    renewals may move. Raises Aborted once the deadline passes or a renewal is refused first."""
    get, refused = asyncio.ensure_future(queue.get()), asyncio.ensure_future(lease.refused.wait())
    try:
        while (left := lease.deadline - time.monotonic()) > 0 and not refused.done():
            await asyncio.wait({get, refused}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if get.done():
                return get.result()
        if refused.done():
            raise Aborted("the decode worker refused to renew the reservation's lease")
        raise Aborted("the reservation's lease ended before the prompt was computed")
    finally:
        get.cancel(), refused.cancel()


async def _wait_out(write: asyncio.Future) -> None:
    """Wait until the write thread has ended (it does by its deadline).

    NOTE: swallows further cancellations on purpose: until the write ends it may still read
    this worker's blocks and write the destination's, so neither may be freed before.
    """
    while not write.done():
        try:
            await asyncio.wait({write})
        except asyncio.CancelledError:
            continue


def _failure_kind(exc: BaseException, write: asyncio.Future | None) -> str | None:
    """The KV transfer failure a handoff's ``exc`` means (a ``KV_FAILURE_REASONS`` entry of
    ``services.observability.metrics``), or None when it was no transfer failure (cancelled,
    bad input, the engine's error)."""
    if write is not None and not write.cancelled() and write.exception() is not None:
        return "transfer_error"
    if isinstance(exc, Aborted) and "lease" in str(exc):
        return "lease"  # it ran out (or was refused) before the prompt was computed
    return None


def _failed(write: asyncio.Future) -> bool:
    return write.cancelled() or write.exception() is not None


def _reason(exc: BaseException, write: asyncio.Future | None) -> str:
    if write is not None and not write.cancelled() and write.exception() is not None:
        return f"KV transfer failed: {write.exception()}"
    if isinstance(exc, asyncio.CancelledError):
        return "prefill cancelled"
    return str(exc) or type(exc).__name__
