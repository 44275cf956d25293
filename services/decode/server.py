"""Decode worker: reserves KV blocks for a prompt, admits the sequence into its running batch
once a prefill worker has written the prompt's KV, and streams every output token.

A reservation's blocks are freed only when no KV write into them can be in flight (see
``reservations.py``). If the KV does not arrive (the prefill worker reports that it was not
written, or the lease ends) the request's ``kv_failure_policy`` decides: ``recompute`` computes
the prompt here in the reserved blocks, ``fail`` frees them and ends the stream with ABORTED.

Token messages go either on the request's own ``Decode`` stream or, when the request names a
``Follow`` stream (the gateway's way), on that one: one message per step carries the updates of
every request it follows, instead of one message per request (``FollowStream``; one gRPC message
costs the worker and the gateway more CPU than the step's whole bookkeeping for the request).

Whichever stream carries its tokens holds a lease on the blocks of its running requests
(``local_prefill`` ones included): a consumer that leaves ready tokens unread for ``kv_lease_s``
has its requests released, so no caller can pin blocks by not reading (``_ReadLease``).
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Callable
from contextlib import aclosing

from services.api import worker_pb2, worker_pb2_grpc
from services.decode.reservations import Outcome, Reservations
from services.engine import commands
from services.engine.outputs import RequestOutput
from services.engine.request import Request
from services.engine.sampler import TokenLogprobs
from services.engine.sampling_params import SamplingParams
from services.kv_transfer import KVTransport
from services.kv_transfer.grants import new_token
from services.observability import tracing
from services.observability.logs import bind_request
from services.errors import Aborted, InvalidArgument, ResourceExhausted, Unavailable
from services.api.convert import logprobs_to_proto, params_from_proto, prompt_logprobs_to_proto
from services.runtime.worker import WorkerRuntime

log = logging.getLogger(__name__)

FAIL = worker_pb2.KV_FAILURE_POLICY_FAIL


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime
        self.transport = self._create_transport()
        self.reservations = Reservations(runtime.release)
        runtime.reservations = self.reservations
        self.follows: dict[str, FollowStream] = {}  # open Follow streams by follower_id
        self.GetLoad = runtime.GetLoad

    def _create_transport(self) -> KVTransport | None:
        """The KV transport prefill workers write this worker's reservations through."""
        return self.rt.create_transport(self.rt.options.kv_port)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def stopping(self) -> None:
        """The gRPC server stops next: every Follow stream ends (OK) once it has sent what it
        holds, so the server's grace period waits only for calls that end on their own."""
        for follow in self.follows.values():
            follow.end()

    def busy(self) -> bool:
        """Whether a reservation is open (its blocks wait for a KV write or its lease)."""
        return len(self.reservations) > 0

    def hand_back(self) -> int:
        """Drain deadline (services/runtime/drain.py): end every stream with UNAVAILABLE, so the gateway
        migrates it to another decode worker; a stream still waiting for its KV leaves its
        reservation quarantined until no write can land. Returns how many streams."""
        n = self.rt.hand_back_streams()
        for rid in list(self.rt.streams):
            self.reservations.abort(rid)
        return n

    def _on_notification(self, rid: str, notification: bytes) -> None:
        """Transport thread, after the write admitted by ``rid``'s grant landed: post the note
        to the event loop. Raises ValueError on a malformed note, or one naming another
        request (the sender's write then fails; the grant is used up either way)."""
        note = json.loads(notification)
        if not isinstance(note, dict) or note.get("request_id") != rid:
            raise ValueError(f"KV notification for reservation {rid!r} names another request: "
                             f"{notification[:200]!r}")
        kind = note.get("status", "landed")
        if kind not in ("landed", "not_written"):
            raise ValueError(f"request {rid}: unknown KV notification status {kind!r}")
        self.rt.loop.call_soon_threadsafe(self.reservations.close, rid, Outcome(kind, note))

    def _on_write_lost(self, rid: str, reason: str) -> None:
        """Transport thread: an admitted write broke off; nothing more of it lands."""
        note = {"request_id": rid, "status": "not_written", "reason": reason}
        self.rt.loop.call_soon_threadsafe(self.reservations.close, rid, Outcome("not_written", note))

    def _grant(self, rid: str, block_ids: list[int]) -> tuple[bytes, asyncio.Future]:
        """Grant one write into ``block_ids`` and start the lease: (write token, outcome)."""
        lease_s, token = self.rt.options.kv_lease_s, new_token()
        self.transport.grant_write(token, block_ids, lease_s,
                                   functools.partial(self._on_notification, rid),
                                   functools.partial(self._on_write_lost, rid))
        outcome = self.reservations.open(
            rid, lease_s, functools.partial(self.transport.lease_left, token),
            functools.partial(self.transport.revoke, token),
            functools.partial(self.transport.stop_renewals, token))
        return token, outcome

    def open_reservation(self, req: Request) -> tuple[worker_pb2.KVReservation, asyncio.Future]:
        """Open the reservation of ``req`` (blocks reserved by the engine): the prefix its
        prefix cache held is pinned, so only the blocks after it are granted to the writer,
        less those before a sliding window that covers every layer (never read); of the
        rest, those before the sliding layers' window of a mixed model are written for its
        global layers only."""
        num_cached = req.num_cached_tokens // self.rt.engine.block_manager.block_size
        skipped = self.rt.engine.scheduler.skipped_prompt_blocks(req)  # before the window
        partial = self.rt.engine.scheduler.partial_prompt_blocks(req)
        writable = list(req.block_table[num_cached + skipped:])
        token, outcome = self._grant(req.request_id, writable)
        return worker_pb2.KVReservation(
            worker_id=self.rt.worker_id, transport=self.rt.options.kv_transport,
            transport_metadata=self.transport.metadata(), block_ids=writable,
            lease_s=self.rt.options.kv_lease_s, write_token=token,
            num_cached_blocks=num_cached, num_skipped_blocks=skipped,
            num_partial_blocks=partial), outcome

    async def Decode(self, request: worker_pb2.DecodeRequest, context):
        """One request's stream: admit it (``local_prefill``: compute the prompt here; else
        reserve blocks, send the reservation and wait for the prompt's KV), then one message per
        batch of outputs until the finishing one, here or (``follower_id``) on that Follow
        stream, this one then carrying an empty message once a ``local_prefill`` request is
        admitted. Raises ValueError (INVALID_ARGUMENT) naming a field, ResourceExhausted when
        too few KV blocks are free, Aborted, Unavailable (also when the Follow stream named is
        not open, or ends first)."""
        params = params_from_proto(request.sampling_params)
        if request.request_id in self.reservations:
            raise InvalidArgument("request_id", f"{request.request_id!r} still holds a reservation "
                                  "on this worker")
        follow = None
        if request.follower_id:
            follow = self.follows.get(request.follower_id)
            if follow is None:
                raise Unavailable(f"decode worker {self.rt.worker_id}: no Follow stream "
                                  f"{request.follower_id!r} is open (follower_id)")
        stream = _DecodeStream(self, request, params, context, follow)
        try:
            if request.local_prefill:
                await stream.prefill_here()
                if follow is not None:
                    yield worker_pb2.DecodeResponse()  # admitted: its tokens go to the follower
            else:
                reservation, outcome = await stream.reserve()
                yield worker_pb2.DecodeResponse(reservation=reservation)
                await stream.wait_for_kv(outcome)
            async with aclosing(stream.messages()) as messages:
                async for msg in messages:
                    yield msg
        except BaseException as exc:
            stream.trace.fail(exc)
            raise
        finally:
            stream.close()

    async def Abort(self, request: worker_pb2.WorkerAbortRequest, context):
        """End the request's stream; its blocks are freed once no KV write can land in them
        (at once with ``reservation_unused``)."""
        rid = request.request_id
        if request.reservation_unused and self.reservations.close(rid, Outcome("unused")):
            found = True  # a waiting stream ends with ABORTED; a detached one is freed now
        elif self.reservations.abort(rid):
            found = True  # a waiting stream ends with ABORTED; the blocks stay quarantined
        elif (queue := self.rt.streams.get(rid)) is not None:
            self.rt.release(rid)  # decoding: nothing writes into its blocks any more
            queue.put_nowait(RequestOutput(rid, [], "abort"))
            found = True
        else:
            found = await self.rt.call(commands.Abort(rid))
        return worker_pb2.WorkerAbortResponse(found=found)

    async def Follow(self, request: worker_pb2.FollowRequest, context):
        """The token messages of every request whose Decode names ``follower_id``: an empty
        message first (the follower is open), then each time updates are ready, all of them.
        Raises ValueError (INVALID_ARGUMENT) naming ``follower_id`` when it is short or already
        open, Aborted when ready updates were left unread for ``kv_lease_s``."""
        fid = request.follower_id
        if len(fid) < 16:
            raise InvalidArgument("follower_id", f"{fid!r}: need 16 or more characters (random hex)")
        if fid in self.follows:
            raise InvalidArgument("follower_id", f"{fid!r} is already open on this worker")
        follow = self.follows[fid] = FollowStream(self.rt, fid)
        try:
            yield worker_pb2.FollowResponse()
            while (updates := await follow.take()) is not None:
                yield worker_pb2.FollowResponse(updates=updates)
                follow.lease.renew()
        finally:
            del self.follows[fid]
            follow.close("the Follow stream ended")


class FollowStream:
    """One ``Follow`` call's state: the updates ready for its caller, at most one per request
    (a request's later messages merge into its pending one: tokens and logprobs append, the
    last finish reason and count win), and the requests whose tokens it carries. Closing it
    (its call ended, or its lease ran out) releases those requests; their ``Decode`` streams
    then end with UNAVAILABLE."""

    def __init__(self, rt: WorkerRuntime, follower_id: str) -> None:
        self.rt, self.id = rt, follower_id
        self.pending: dict[str, worker_pb2.DecodeResponse] = {}  # by request id, in send order
        self.requests: dict[str, _DecodeStream] = {}  # decoding requests sending here
        self.closed = ""  # why, once closed
        self.ending = False  # the worker stops: end once nothing is pending
        self._ready = asyncio.Event()
        self.lease = _ReadLease(f"Follow stream {follower_id}", rt.options.kv_lease_s,
                                lambda: bool(self.pending), self._expire)

    def send(self, rid: str, msg: worker_pb2.DecodeResponse) -> None:
        """Queue ``msg`` for the follower. Raises Unavailable once the stream is closed."""
        if self.closed:
            raise Unavailable(f"decode worker {self.rt.worker_id}: Follow stream {self.id} "
                              f"closed ({self.closed}) before request {rid} finished")
        pending = self.pending.get(rid)
        if pending is None:
            msg.request_id = rid
            self.pending[rid] = msg
        else:
            pending.MergeFrom(msg)
        self._ready.set()

    async def take(self) -> list[worker_pb2.DecodeResponse] | None:
        """Wait for updates and take them all; None once ``end()`` was called and nothing is
        pending. Raises Aborted once the lease closed the stream."""
        await self._ready.wait()
        if self.closed:
            raise Aborted(f"decode worker {self.rt.worker_id}: {self.closed}")
        if not self.pending and self.ending:
            return None
        self._ready.clear()
        updates, self.pending = list(self.pending.values()), {}
        if self.ending:
            self._ready.set()  # the next take ends the stream
        return updates

    def end(self) -> None:
        """End the stream (OK) once what is pending went out."""
        self.ending = True
        self._ready.set()

    def _expire(self) -> None:
        self.close(f"ready tokens left unread for {self.rt.options.kv_lease_s:.1f}s or more "
                   "(kv_lease_s)")

    def close(self, why: str) -> None:
        """Release every request still sending here; later sends raise, and a waiting
        ``take()`` raises Aborted with ``why`` (idempotent)."""
        if self.closed:
            return
        self.closed = why
        self.lease.close()
        for stream in list(self.requests.values()):
            stream.end()
        self._ready.set()


class _DecodeStream:
    """One ``Decode`` call's state (as the gateway's ``_Attempt`` is one attempt's): its output
    queue, lease and trace, and what the engine holds for it. The call reads top to bottom:
    admission (``prefill_here``, or ``reserve`` then ``wait_for_kv``), ``messages()``, ``close()``.
    """

    def __init__(self, worker: DecodeServicer, request: worker_pb2.DecodeRequest,
                 params: SamplingParams, context, follow: FollowStream | None) -> None:
        self.worker, self.rt = worker, worker.rt
        self.rid = request.request_id
        self.prompt = list(request.prompt_token_ids)
        self.params = params
        self.kv_failure_policy = request.kv_failure_policy
        self.queue = self.rt.open_stream(self.rid)
        self.follow = follow  # carries the token messages; None: this stream does
        self.done: asyncio.Future | None = None  # followed: set by the finishing output
        self.lease = None if follow is not None else _ReadLease(
            f"request {self.rid}", self.rt.options.kv_lease_s,
            lambda: not self.queue.empty(), self.end)
        self.trace = tracing.worker_trace("decode", context, self.rid, len(self.prompt))
        bind_request(self.rid, self.trace)
        self.req: Request | None = None  # the engine's request, once admitted
        self.owned = False  # the engine may hold a request of ours under rid
        self.finished = False  # the message with the finish reason was built
        self.computed_here = False  # this worker computed the prompt (not a prefill worker)
        self.kv_recomputed = ""  # why the prompt's KV was computed here after all

    async def _admit(self, command: commands.AddRequest | commands.Reserve) -> None:
        """Hand the request to the engine. Raises ValueError naming a field, or
        ResourceExhausted when too few KV blocks are free (the engine then holds nothing)."""
        self.owned = True  # before the await: cancelled after the engine took it, it is freed
        try:
            self.req = await self.rt.call(command)
        except ValueError:
            self.owned = False  # refused: the engine holds nothing of ours under rid
            raise
        if self.req is None:
            self.owned = False
            raise ResourceExhausted(f"decode worker {self.rt.worker_id}: not enough free KV "
                                    f"blocks for {len(self.prompt)} prompt tokens")

    async def prefill_here(self) -> None:
        """``local_prefill``: the engine schedules the prompt beside its running batch
        (chunked prefill); no reservation, no KV write."""
        await self._admit(commands.AddRequest(self.rid, self.prompt, self.params))
        self.computed_here = True

    async def reserve(self) -> tuple[worker_pb2.KVReservation, asyncio.Future[Outcome]]:
        """Reserve blocks for the prompt's KV and grant a prefill worker one write into them:
        (the reservation to send, its outcome)."""
        await self._admit(commands.Reserve(self.rid, self.prompt, self.params))
        return self.worker.open_reservation(self.req)

    async def wait_for_kv(self, outcome: asyncio.Future[Outcome]) -> None:
        """The reservation closed: admit the request with its first token, or compute the
        prompt here (policy recompute). Raises Aborted, or Unavailable when draining."""
        kv = await self.trace.kv_wait(outcome, self.kv_failure_policy != FAIL)
        await self._start(kv)
        if kv.kind != "landed":
            self.kv_recomputed, self.computed_here = f"{kv.kind}: {kv.why}", True

    async def _start(self, outcome: Outcome) -> None:
        rid = self.rid
        if outcome.kind == "landed":
            note = outcome.note
            logprobs = TokenLogprobs.from_dict(note["logprobs"]) if note.get("logprobs") else None
            out = await self.rt.call(commands.FinishRemotePrefill(
                rid, int(note["first_token_id"]), logprobs))
            if out is None:
                raise Aborted(f"request {rid} is no longer waiting for its KV")
            self.queue.put_nowait(out)
            return
        if outcome.kind == "aborted" and self.rt.handed_back:
            raise Unavailable(f"decode worker {self.rt.worker_id} is draining: request {rid} "
                              "handed back before its KV arrived")
        if outcome.kind in ("unused", "aborted"):
            raise Aborted(f"request {rid}: {outcome.why}")
        if self.kv_failure_policy != FAIL:
            log.info("request %s: %s; computing the prompt here (kv failure policy: recompute)",
                     rid, outcome.why)
            if await self.rt.call(commands.PrefillLocally(rid)):
                return
        raise Aborted(f"decode worker {self.rt.worker_id}: {outcome.why} (kv failure policy: fail)")

    async def messages(self):
        """One DecodeResponse per batch of queued outputs, up to the finishing one; the lease is
        renewed each time the consumer takes one. Followed, the messages go to the Follow stream
        instead and this yields nothing (``_follow_outputs``). Raises what ``check_output``
        raises, Unavailable when the Follow stream closed."""
        if self.follow is not None:
            await self._follow_outputs()
            return
        async for outs in _batches(self.queue):
            yield self._message(outs)
            self.lease.renew()
            if self.finished:
                return

    async def _follow_outputs(self) -> None:
        """Send the outputs queued so far to the Follow stream (in order: see ``_batches``),
        then take the runtime's later ones directly (``put_nowait``: no task wakes per token)
        until the finishing one. Raises what ``check_output`` raises, Unavailable."""
        follow = self.follow
        follow.requests[self.rid] = self
        if follow.closed:
            raise Unavailable(f"Follow stream {follow.id} closed ({follow.closed})")
        queued = []
        while not self.queue.empty():
            queued.append(self.queue.get_nowait())
        if queued:
            follow.send(self.rid, self._message(_in_order(queued)))
            if self.finished:
                return
        self.done = asyncio.get_running_loop().create_future()
        self.rt.streams[self.rid] = self  # the runtime's outputs come to put_nowait now
        await self.done

    def put_nowait(self, out: RequestOutput) -> None:
        """A followed request's output, from the runtime (in place of its queue): to the Follow
        stream at once; the finishing one, or an error, ends ``_follow_outputs``."""
        if self.done.done():
            return
        try:
            self.follow.send(self.rid, self._message([out]))
        except Exception as exc:  # noqa: BLE001 -- the handler raises it (its gRPC status)
            self.done.set_exception(exc)
            return
        if self.finished:
            self.done.set_result(None)

    def end(self) -> None:
        """Release the request now (its lease ran out, or its Follow stream closed); the
        stream's handler then ends."""
        self.rt.release(self.rid)
        self.rt.streams.get(self.rid, self.queue).put_nowait(  # the handler's wake-up
            RequestOutput(self.rid, [], "abort"))

    def _message(self, outs: list[RequestOutput]) -> worker_pb2.DecodeResponse:
        """One message of ``outs`` (consecutive outputs of this request). Raises what
        ``check_output`` raises. NOTE: runs for every output token on the worker's event loop,
        which shares the GIL with the engine thread: only the fields an output has are set
        (an empty message filled in is a quarter of the cost of one built from keywords)."""
        for out in outs:
            if out.error is not None:
                self.rt.check_output(out)  # failed alone, or the engine died: an error
        last = outs[-1]
        msg = worker_pb2.DecodeResponse()
        for out in outs:
            msg.token_ids.extend(out.new_token_ids)
            if out.logprobs:
                msg.logprobs.extend(logprobs_to_proto(lp) for lp in out.logprobs)
            if out.prompt_logprobs:
                msg.prompt_logprobs.extend(prompt_logprobs_to_proto(out.prompt_logprobs))
        msg.num_output_tokens = last.num_output_tokens
        if last.finish_reason is not None:
            msg.finish_reason, self.finished = last.finish_reason, True
        if self.computed_here:  # the first message reports them
            msg.kv_recomputed = self.kv_recomputed
            msg.num_cached_tokens = max(self.req.num_cached_tokens, 0)
            self.kv_recomputed, self.computed_here = "", False
        return msg

    def close(self) -> None:
        """Client gone, abort, error or done: free what the request holds, unless a KV write
        may still land in it (its reservation stays quarantined until it closes)."""
        self.trace.end_decode(self.req)
        if self.lease is not None:
            self.lease.close()
        if self.follow is not None:
            self.follow.requests.pop(self.rid, None)
        self.rt.streams.pop(self.rid, None)
        if self.owned and not self.finished and not self.worker.reservations.detach(self.rid):
            self.rt.release(self.rid)


class _ReadLease:
    """A stream's lease on the blocks of the running requests it carries: tokens ready for the
    consumer must be taken within ``lease_s`` seconds; after that ``expire()`` releases them
    (aborted, blocks freed), as an unused reservation's blocks are at its lease's end. Checked
    every third of the lease on the event loop: ``unread()`` true at one check with no message
    taken before a check ``lease_s`` later. ``renew()`` after each message the consumer took."""

    def __init__(self, what: str, lease_s: float, unread: Callable[[], bool],
                 expire: Callable[[], None]) -> None:
        self.what, self.lease_s, self.unread, self.expire = what, lease_s, unread, expire
        self.read_at = time.monotonic()
        self._task = asyncio.ensure_future(self._watch())

    def renew(self) -> None:
        self.read_at = time.monotonic()

    def close(self) -> None:
        self._task.cancel()

    async def _watch(self) -> None:
        unread_since: float | None = None  # first check that saw tokens waiting, none taken since
        while True:
            await asyncio.sleep(self.lease_s / 3)
            now, unread = time.monotonic(), self.unread()
            if not unread or (unread_since is not None and self.read_at > unread_since):
                unread_since = None
            if not unread:
                continue
            if unread_since is None:
                unread_since = now
            elif now - unread_since >= self.lease_s:
                log.warning("%s: ready tokens left unread for %.1fs (lease %.1fs): released",
                            self.what, now - unread_since, self.lease_s)
                self.expire()
                return


async def _batches(queue: asyncio.Queue[RequestOutput]):
    """Yield every output queued so far as one list, in output order (``_in_order``)."""
    while True:
        outs = [await queue.get()]
        while not queue.empty():
            outs.append(queue.get_nowait())
        yield _in_order(outs)


def _in_order(outs: list[RequestOutput]) -> list[RequestOutput]:
    """``outs`` (one request's, as queued) in output order. The first token's output is queued
    by ``_start`` once the landing command returns, which can be after the engine's next step
    already queued the second token's; both are queued before the stream first reads, so
    ordering what is there by ``num_output_tokens`` restores the sequence (taken as they came,
    the stream once sent token #0 and lost #1). A finished output goes last whatever its count:
    an abort queued by the lease or ``Abort`` carries none, and sorted first it would leave the
    stream waiting for an end it already had."""
    outs.sort(key=lambda o: (o.finish_reason is not None, o.num_output_tokens))
    return outs
