"""One request's path across the workers, and what happens when one of them fails.

An *attempt*: reserve KV blocks on a decode worker D (its Decode stream's first message), send
the prompt to a prefill worker P with D's reservation as destination, relay D's tokens.

- D dies mid-stream (UNAVAILABLE, or the stream ends unfinished): *migrate*. A new attempt on
  another decode worker gets prompt + tokens generated so far as its prompt (max_tokens and
  min_tokens reduced by as many); tokens are deduplicated by count, so the client's stream goes
  on with no gap and no repeat. Greedy output equals an uninterrupted run.
- P dies before the first token: *retry* with a new reservation on another prefill worker. The
  old reservation stays held by D until its lease ends (P may have been writing into it).
- P answers that the KV was not written (ABORTED) or times out: D applies the request's
  ``kv_failure_policy`` (recompute locally, or fail the stream); the gateway just keeps reading.
- Every prefill queue full: RESOURCE_EXHAUSTED; D is told the reservation was never used and
  frees it at once (``reservation_unused``), as on every cancel before the prefill was sent.

- A *unified* worker (``services/unified``) was chosen, or the router decided that the decode
  worker computes the prompt itself (conditional disaggregation, ``router.py``): the Decode
  stream has ``local_prefill`` and no prefill hop follows; its first message says the worker
  admitted it. Refused: try the next worker; lost after: retry, or migrate once tokens came.

Tokens do not come on the Decode stream: each attempt names the gateway's ``Follower`` on its
worker (``follow.py``), one stream that carries every attempt's tokens there; the Decode stream
ends with the attempt's status once its finishing message went to the follower.

Which workers, in which order: ``Router`` (``gateway.routing``). A decode worker that already
holds a prefix of the prompt pins it in its reservation (``KVReservation.num_cached_blocks``) and
the prefill worker writes only the blocks after it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.api import worker_pb2, worker_pb2_grpc
from services.errors import ResourceExhausted, Unavailable
from services.gateway.follow import Follower, FollowLost, Inbox
from services.gateway.resume import only_new, resumed_params
from services.gateway.router import Route, Router, Ticket
from services.gateway.routing import WorkerPool
from services.gateway.scoring import FALLBACK
from services.observability.tracing import NO_TRACE
from services.rpc import invalid_argument
from services.state.registry import WorkerInfo

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 4  # per request: the first, plus retries and migrations
ABORT_TIMEOUT_S = 5.0  # deadline of the Abort that frees an unused reservation
# how long a stream's last message waits for the prefill worker's answer, which is on its way
# once the KV landed (its timings go into the request's record and trace)
PREFILL_ANSWER_S = 1.0
LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)  # the worker is gone


class WorkerLost(Exception):
    def __init__(self, worker: WorkerInfo, why: str) -> None:
        super().__init__(f"{worker.role} worker {worker.worker_id}: {why}")
        self.worker = worker


class _HandoffFailed(Exception):
    """The prefill worker did not write the KV; the decode worker's policy takes over."""


@dataclass
class Job:
    """One client request as the dispatcher sees it."""

    request_id: str
    prompt: list[int]
    params: worker_pb2.SamplingParams
    track: Callable[[object], object]  # registers a call or task that Abort must cancel
    on_dispatch: Callable[[str, str, bool], None]  # (decode worker, prefill worker, resumed)
    on_prefilled: Callable[[worker_pb2.PrefillResponse], None]  # its timings go to the record
    trace: Any = NO_TRACE  # the request's span (services.observability.tracing)


@dataclass
class _Attempt:
    worker_request_id: str
    decode: WorkerInfo | None = None
    local: bool = False  # the decode (or unified) worker computes the prompt itself
    call: object = None  # the Decode stream
    follower: Follower | None = None  # carries the attempt's tokens (into inbox)
    inbox: Inbox | None = None
    reservation: worker_pb2.KVReservation | None = None
    reserved_at: float = 0.0  # monotonic time the Decode request was sent (lease start bound)
    prefill: asyncio.Task | None = None
    maybe_written: bool = False  # some prefill worker may write into the reservation
    ticket: Ticket | None = None  # the decode worker's load from this request (Router)
    prefill_workers: list[WorkerInfo] = field(default_factory=list)  # live when routed


class Dispatcher:
    """``stream(job)`` yields the request's DecodeResponses (only new tokens, counted over the
    whole request) across retries and migrations. Raises ResourceExhausted, Unavailable,
    ValueError; CancelledError when aborted."""

    def __init__(self, pool: WorkerPool, router: Router, rpc_timeout_s: float,
                 kv_failure_policy: str,
                 on_worker_lost: Callable[[bool], None] = lambda had_tokens: None) -> None:
        self.pool = pool
        self.router = router
        self.on_worker_lost = on_worker_lost  # (tokens already sent: a migration, else a retry)
        self.rpc_timeout_s = rpc_timeout_s
        self.policy = {"recompute": worker_pb2.KV_FAILURE_POLICY_RECOMPUTE,
                       "fail": worker_pb2.KV_FAILURE_POLICY_FAIL}[kv_failure_policy]
        self._background: set[asyncio.Task] = set()
        self._followers: dict[str, Follower] = {}  # by worker endpoint

    def close(self) -> None:
        """Close the Follow streams this gateway opened (their workers release what they
        carried)."""
        for follower in self._followers.values():
            follower.close()
        self._followers.clear()

    async def _follower(self, worker: WorkerInfo) -> Follower:
        """The open Follow stream on ``worker`` (opened now if there is none, or it ended).
        Raises FollowLost."""
        follower = self._followers.get(worker.endpoint)
        if follower is None or follower.lost:
            follower = self._followers[worker.endpoint] = Follower(self.pool.channel(worker.endpoint))
        await follower.ready(self.rpc_timeout_s)
        return follower

    async def stream(self, job: Job) -> AsyncIterator[worker_pb2.DecodeResponse]:
        generated: list[int] = []
        for n in range(MAX_ATTEMPTS):
            base = len(generated)
            params = resumed_params(job.params, base)
            try:
                async with aclosing(self._attempt(job, n, job.prompt + generated, params)) as msgs:
                    async for msg in msgs:
                        msg = only_new(msg, base, len(generated))
                        generated.extend(msg.token_ids)
                        yield msg
                        if msg.finish_reason:
                            return
            except WorkerLost as exc:
                self._lost(exc.worker, str(exc))
                job.trace.event("migration" if generated else "retry", reason=str(exc),
                                **{"tandem.num_generated_tokens": len(generated)})
                if n + 1 < MAX_ATTEMPTS:  # another attempt follows
                    self.on_worker_lost(bool(generated))
                log.warning("request %s: %s; %s with %d tokens generated", job.request_id, exc,
                            "migrating" if generated else "retrying", len(generated))
        raise Unavailable(f"workers failed {MAX_ATTEMPTS} times in a row; retry later")

    async def _attempt(self, job: Job, n: int, prompt: list[int], params: worker_pb2.SamplingParams):
        att = _Attempt(job.request_id if n == 0 else f"{job.request_id}~{n}")
        try:
            with job.trace.child("kv_reservation", **{"tandem.attempt": n}) as span:
                route = await self._reserve(job, att, prompt, params, resumed=n > 0)
                attributes = {"tandem.decode_worker": att.decode.worker_id,
                              "tandem.kv_reservation.blocks":
                                  len(att.reservation.block_ids) if att.reservation else 0,
                              "tandem.kv_reservation.cached_blocks":
                                  att.reservation.num_cached_blocks if att.reservation else 0,
                              **route.attributes}
                span.set(**attributes)
                job.trace.annotate(**attributes)
            if att.reservation is not None:  # else the decode worker computes the prompt itself
                att.prefill = job.track(asyncio.ensure_future(
                    self._prefill(job, att, prompt, params, resumed=n > 0)))
            async with aclosing(self._relay(job, att)) as msgs:
                async for msg in msgs:
                    yield msg
        finally:
            self._release(att)

    async def _reserve(self, job: Job, att: _Attempt, prompt: list[int],
                       params: worker_pb2.SamplingParams, resumed: bool) -> Route:
        """Open a Decode stream on the best decode or unified worker (``Router``) with room for
        the prompt, its tokens to come through the worker's follower: a decode worker's first
        message is its reservation, unless it computes the prompt itself (unified, or
        conditional disaggregation): then an empty one (admitted). Returns the route taken."""
        workers, att.prefill_workers = await self._live_workers()
        routes = self.router.rank_decode(prompt, workers, att.prefill_workers)
        lost = 0
        for i, route in enumerate(routes):
            w, local = route.worker, route.local_prefill or route.worker.role == "unified"
            if local:  # the prefill starts now, on this worker
                job.on_dispatch(w.worker_id, w.worker_id, resumed)
            try:
                follower = await self._follower(w)
                att.follower, att.inbox = follower, follower.register(att.worker_request_id)
            except FollowLost as exc:
                self._lost(w, str(exc))
                lost += 1
                continue
            att.decode, att.reserved_at = w, time.monotonic()  # cancelled from here: freed unused
            sent_at = time.time()  # the worker's heartbeats may count it from here
            att.call = call = job.track(worker_pb2_grpc.DecodeWorkerStub(
                self.pool.channel(w.endpoint)).Decode(worker_pb2.DecodeRequest(
                    request_id=att.worker_request_id, prompt_token_ids=prompt,
                    sampling_params=params, kv_failure_policy=self.policy,
                    local_prefill=local, follower_id=att.follower.id),
                timeout=self.rpc_timeout_s, metadata=job.trace.metadata()))
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as exc:
                att.follower.unregister(att.worker_request_id)
                att.decode = att.call = att.follower = att.inbox = None  # nothing reserved
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    continue
                if exc.code() in LOST:
                    self._lost(w, f"{exc.code().name}: {exc.details()}")
                    lost += 1
                    continue
                raise _status_error(w, exc) from exc
            if i > 0:
                route.reason = FALLBACK
            att.local = local
            if local and first is not grpc.aio.EOF:
                att.ticket = self.router.routed(route, prompt, computes=True, sent_at=sent_at)
                return route
            if first is grpc.aio.EOF or not first.HasField("reservation"):
                raise Unavailable(f"{w.role} worker {w.worker_id} answered with no "
                                  f"{'admission' if local else 'reservation'}")
            att.reservation = first.reservation
            att.ticket = self.router.routed(route, prompt, computes=False, sent_at=sent_at)
            return route
        if lost == len(routes):
            raise Unavailable("no decode or unified worker could be reached")
        raise ResourceExhausted("no decode or unified worker has room for this request; "
                                "retry later")

    def _lost(self, worker: WorkerInfo, why: str) -> None:
        self.pool.lost(worker, why)
        self.router.lost(worker.worker_id, self.pool.suspect_s)

    async def _live_workers(self) -> tuple[list[WorkerInfo], list[WorkerInfo]]:
        """The live decode or unified workers, and the live prefill workers ([] when there is
        none, or only unified workers serve), read from the registry concurrently: each role's
        listing is two Redis round trips, and one after another they were most of the time a
        request spent in the gateway before its prefill started. Raises Unavailable (no
        decode or unified worker)."""
        async def prefill() -> list[WorkerInfo]:
            try:
                return await self.pool.live("prefill")
            except Unavailable:
                return []

        workers, prefill_workers = await asyncio.gather(
            self.pool.live_any(("decode", "unified")), prefill())
        return workers, ([] if all(w.role == "unified" for w in workers) else prefill_workers)

    async def _prefill(self, job: Job, att: _Attempt, prompt: list[int],
                       params: worker_pb2.SamplingParams, resumed: bool) -> worker_pb2.PrefillResponse:
        """Send the prompt to the best prefill worker (``Router``: its own cache and load)
        whose queue has room; its answer."""
        # the listing the reservation was routed with, a moment ago
        workers = att.prefill_workers or await self.pool.live("prefill")
        for i, route in enumerate(self.router.rank_prefill(prompt, workers)):
            w = route.worker
            lease_left = att.reservation.lease_s - (time.monotonic() - att.reserved_at)
            dest = worker_pb2.KVReservation()
            dest.CopyFrom(att.reservation)
            dest.lease_s = lease_left
            att.maybe_written = True
            job.on_dispatch(att.decode.worker_id, w.worker_id, resumed)
            if i > 0:
                route.reason = FALLBACK
            ticket = self.router.routed(route, prompt, computes=True, sent_at=time.time())
            job.trace.annotate(**{"tandem.prefill_worker": w.worker_id,
                                  "tandem.routing.prefill_reason": route.reason,
                                  "tandem.routing.prefill_overlap_blocks": route.overlap_blocks})
            stub = worker_pb2_grpc.PrefillWorkerStub(self.pool.channel(w.endpoint))
            sent = time.monotonic()
            try:
                result = await stub.Prefill(worker_pb2.PrefillRequest(
                    request_id=att.worker_request_id, prompt_token_ids=prompt,
                    sampling_params=params, destination=dest),
                    timeout=self.rpc_timeout_s, metadata=job.trace.metadata())  # NOTE: the
                # prefill worker renews the lease
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details()
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    att.maybe_written = False  # refused before touching the reservation
                    continue
                if code in LOST:
                    raise WorkerLost(w, f"{code.name}: {details}") from exc
                if code in (grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise _HandoffFailed(details) from exc
                raise _status_error(w, exc) from exc
            finally:
                ticket.ended()
            self.router.observe_handoff(
                w.worker_id, att.decode.worker_id, len(dest.block_ids),
                time.monotonic() - sent - result.queue_time_s - result.compute_time_s)
            job.on_prefilled(result)
            return result
        raise ResourceExhausted("every prefill worker's queue is full; retry later")

    async def _relay(self, job: Job, att: _Attempt):
        """Yield the attempt's token messages from its inbox (merged when several wait); watch
        the Decode stream's end and the prefill's answer there too."""
        inbox, prefill, got_tokens = att.inbox, att.prefill, False
        prefilled: worker_pb2.PrefillResponse | None = None  # the prefill worker's answer
        if prefill is not None:
            prefill.add_done_callback(inbox.put)
        end = job.track(asyncio.ensure_future(_decode_end(att.decode, att.call)))
        end.add_done_callback(inbox.put)
        end.add_done_callback(_retrieved)  # its error may come after the relay ended
        ended = False  # the Decode stream ended OK: its finishing message is on its way
        while True:
            if not ended:
                item = await inbox.get()
            else:
                try:
                    item = await asyncio.wait_for(inbox.get(), self.rpc_timeout_s)
                except TimeoutError:
                    raise WorkerLost(att.decode, "stream ended before the request finished") from None
            if isinstance(item, FollowLost):
                raise WorkerLost(att.decode, str(item))
            if item is end:
                end.result()  # raises the stream's error, CancelledError when aborted
                ended = True
                continue
            if not isinstance(item, worker_pb2.DecodeResponse):  # the prefill task
                if item is prefill:
                    prefilled, prefill = _prefill_answer(prefill, got_tokens, job), None
                continue
            msg = item
            if not got_tokens and _wants_prompt_logprobs(job, msg):
                if prefill is not None:  # NOTE: it answers right after the KV landed
                    await asyncio.wait({prefill})
                    prefilled, prefill = _prefill_answer(prefill, False, job), None
                if prefilled is not None:
                    msg.prompt_logprobs.extend(prefilled.prompt_logprobs)
            got_tokens = True
            att.ticket.prefilled()
            if msg.kv_recomputed:  # the decode worker computed the prompt itself
                kind, _, why = msg.kv_recomputed.partition(": ")
                if kind == "expired":  # (a failed transfer is an event already: _prefill)
                    job.trace.event("kv_lease_expired", reason=why)
                job.trace.event("recompute", reason=why)
            elif msg.finish_reason and prefill is not None:
                # NOTE: a short output can end before the prefill worker's answer arrives;
                # cancelled at the release, its timings would be lost from the record
                if (await asyncio.wait({prefill}, timeout=PREFILL_ANSWER_S))[0]:
                    prefilled, prefill = _prefill_answer(prefill, True, job), None
            yield msg
            if msg.finish_reason:
                return

    def _release(self, att: _Attempt) -> None:
        """Cancel what the attempt still runs; free a reservation no prefill worker writes to."""
        if att.ticket is not None:
            att.ticket.ended()
        if att.prefill is not None and not att.prefill.done():
            att.prefill.cancel()  # the prefill worker tells D when nothing more will be written
        if att.call is not None:
            att.call.cancel()  # no-op once finished; otherwise D frees, or quarantines its blocks
        if att.follower is not None:
            att.follower.unregister(att.worker_request_id)
        if att.decode is not None and not att.maybe_written and not att.local:
            stub = worker_pb2_grpc.DecodeWorkerStub(self.pool.channel(att.decode.endpoint))
            task = asyncio.ensure_future(stub.Abort(worker_pb2.WorkerAbortRequest(
                request_id=att.worker_request_id, reservation_unused=True), timeout=ABORT_TIMEOUT_S))
            self._background.add(task)
            task.add_done_callback(_forget(self._background))


def _prefill_answer(prefill: asyncio.Task, got_tokens: bool, job: Job) -> worker_pb2.PrefillResponse | None:
    """The finished prefill's answer; None when it failed in a way the attempt survives (the KV
    handoff failed: the decode worker's policy decides; or the prefill worker was lost after
    the KV landed). Raises the other failures, CancelledError when it was cancelled."""
    if prefill.cancelled():
        raise asyncio.CancelledError()
    exc = prefill.exception()
    if exc is None:
        return prefill.result()
    if isinstance(exc, _HandoffFailed):
        log.info("request %s: KV handoff failed (%s); the decode worker's policy decides",
                 job.request_id, exc)
        job.trace.event("kv_transfer_failed", reason=str(exc))
        return None
    if isinstance(exc, WorkerLost) and got_tokens:
        return None  # the KV had landed: the prefill worker is no longer needed
    raise exc


def _wants_prompt_logprobs(job: Job, first: worker_pb2.DecodeResponse) -> bool:
    """Whether the attempt's first token message must wait for the prefill worker's answer,
    which carries the prompt logprobs (the decode worker sends them only when it computed the
    prompt itself)."""
    return job.params.HasField("prompt_logprobs") and not first.prompt_logprobs and not first.kv_recomputed


async def _decode_end(worker: WorkerInfo, call) -> None:
    """Wait for a followed Decode stream's end (after its reservation, or its admission): returns
    when it ended OK; a lost worker raises WorkerLost, an error status the gateway's own
    exception."""
    try:
        msg = await call.read()
    except grpc.aio.AioRpcError as exc:
        if exc.code() in LOST:
            raise WorkerLost(worker, f"{exc.code().name}: {exc.details()}") from exc
        raise _status_error(worker, exc) from exc
    if msg is not grpc.aio.EOF:
        raise Unavailable(f"{worker.role} worker {worker.worker_id} sent a token message on a "
                          "followed Decode stream")


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def _status_error(worker: WorkerInfo, exc: grpc.aio.AioRpcError) -> Exception:
    """A worker's error status as the gateway's own exception (same status to the client)."""
    code, details = exc.code(), exc.details()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return invalid_argument(details, exc.trailing_metadata())
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(details)
    return Unavailable(f"{worker.role} worker {worker.worker_id} failed: {code.name}: {details}")


def _forget(tasks: set) -> Callable[[asyncio.Task], None]:
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("freeing an unused reservation failed: %s", task.exception())
    return done
