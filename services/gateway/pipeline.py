"""One request's way through the gateway, shared by every front end (gRPC and OpenAI HTTP):
validate → admit → record → relay → detokenize → finish.

``GatewayCore.generate(request)`` runs the whole way for a ``GenerateRequest`` and yields
``GenerateResponse``s; a front end only translates formats and errors. Validation that costs
CPU (chat template, tokenizer) runs on a small thread pool, so a 4 MB prompt never stalls the
event loop that relays every other stream.

Redis: a new request needs its record (UNAVAILABLE naming Redis otherwise); once admitted, a
request never fails because of Redis: its state writes run in order off the request path and
become logged warnings while Redis is away.

Abort and GetRequest act only on requests the caller's API key created (the record holds the
key's id, ``services/gateway/access.py``); without API keys every client is the same anonymous
key, so anyone who can reach the gateway can cancel or read any request whose id they know.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from services.api import gateway_pb2, worker_pb2
from services.api.convert import params_to_proto
from services.engine.output_processor import OutputProcessor
from services.engine.sampling_params import SamplingParams
from services.engine.tokenizer import Tokenizer
from services.errors import InvalidArgument, ResourceExhausted, Unavailable, error_status
from services.gateway import validation
from services.gateway.dispatch import Dispatcher, Job
from services.gateway.model_card import ModelCard
from services.gateway.records import RequestRecord, redis_call
from services.gateway.router import Router, RoutingOptions
from services.gateway.routing import WorkerPool
from services.gateway.validation import RequestLimits
from services.observability import tracing
from services.observability.logs import bind_request
from services.observability.metrics import GatewayMetrics, TokenClock
from services.state.store import RequestState, RequestStateStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """A validated request: what admission and the workers need."""

    request_id: str
    prompt: list[int]  # prompt token ids (chat template applied)
    params: SamplingParams
    trace: tracing.RequestTrace | object = tracing.NO_TRACE  # the request's span (if tracing)
    arrival_time: float = field(default_factory=time.monotonic)  # at the gateway, monotonic s


class GatewayCore:
    """The gateway's request pipeline, independent of the wire protocol.

    ``tokenize_threads`` threads render chat templates and tokenize; ``max_inflight`` bounds the
    requests admitted at once (RESOURCE_EXHAUSTED beyond); ``limits`` bounds one request;
    ``routing`` picks the workers (``router.py``; its KV event follower runs from ``start``).
    """

    def __init__(self, tokenizer: Tokenizer, model: ModelCard, store: RequestStateStore,
                 pool: WorkerPool, rpc_timeout_s: float, kv_failure_policy: str = "recompute",
                 max_inflight: int = 1024, limits: RequestLimits = RequestLimits(),
                 tokenize_threads: int = 2, routing: RoutingOptions = RoutingOptions()) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.store = store
        self.pool = pool
        self.max_inflight = max_inflight
        self.limits = limits
        self._inflight: dict[str, RequestRecord] = {}
        self.metrics = GatewayMetrics(model.name, lambda: len(self._inflight))
        self.router = Router(routing, pool.registry, model.name, self.metrics)
        self.dispatcher = Dispatcher(pool, self.router, rpc_timeout_s, kv_failure_policy,
                                     self.metrics.worker_lost)
        self._tokenize = ThreadPoolExecutor(tokenize_threads, thread_name_prefix="tokenize")
        self._closing: set[asyncio.Task] = set()  # requests recording their outcome
        self.draining = False  # stopping (services/runtime/drain.py): new requests get UNAVAILABLE

    @property
    def num_inflight(self) -> int:
        """Requests admitted and not finished."""
        return len(self._inflight)

    async def close(self) -> None:
        self._tokenize.shutdown(wait=False, cancel_futures=True)
        await self.router.stop()
        self.dispatcher.close()
        await self.pool.close()

    async def generate(self, request: gateway_pb2.GenerateRequest, carrier=None,
                       ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """The whole pipeline for one request. Raises ValueError (bad input, naming the field),
        ResourceExhausted, Unavailable; the last response carries finish_reason and usage.
        ``carrier``: the caller's W3C trace context (``traceparent``; None without tracing)."""
        prepared = await self.prepare(request, carrier)
        record = await self.admit(prepared)
        async with aclosing(self.relay(prepared, record)) as responses:
            async for response in responses:
                yield response

    async def prepare(self, request: gateway_pb2.GenerateRequest, carrier=None) -> Prepared:
        """Validate; render and tokenize the prompt off the event loop; start the request's
        span (child of the trace context in ``carrier``, if tracing). Raises ValueError."""
        t0 = time.monotonic()
        trace = tracing.request_trace(carrier, "chat" if request.messages else "text_completion",
                                      self.model.name)
        try:
            if request.model and request.model != self.model.name:
                raise InvalidArgument("model",
                                      f"{request.model!r} is not served here (serving {self.model.name!r})")
            validation.check_request(request, self.limits)
            rid = request.request_id or uuid.uuid4().hex
            bind_request(rid, trace)
            self._check_new(rid)
            prompt = await asyncio.get_running_loop().run_in_executor(
                self._tokenize, validation.prompt_token_ids, request, self.tokenizer,
                self.model.max_model_len)
            params = validation.sampling_params(request, len(prompt), self.model,
                                                self.limits.max_tokens_cap)
        except BaseException as exc:
            trace.fail(exc)
            self.metrics.request_ended(error_status(exc).grpc_code)
            raise
        trace.requested(rid, params, len(prompt))
        return Prepared(rid, prompt, params, trace, t0)

    async def tokenize(self, request: gateway_pb2.GenerateRequest) -> list[int]:
        """The prompt's token ids, exactly as ``prepare`` makes them (chat template, tools),
        off the event loop. Raises ValueError naming the field."""
        if request.model and request.model != self.model.name:
            raise InvalidArgument("model",
                                  f"{request.model!r} is not served here (serving {self.model.name!r})")
        validation.check_request(request, self.limits)
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize, validation.prompt_token_ids, request, self.tokenizer,
            2**31)  # NOTE: /tokenize counts a prompt of any length

    async def admit(self, prepared: Prepared, key_id: str = "") -> RequestRecord:
        """Take one of ``max_inflight`` places and create the Redis record (QUEUED), owned by
        the API key ``key_id`` (``services/gateway/access.py``).

        Raises ResourceExhausted (gateway full), ValueError (id in flight), Unavailable (Redis,
        or the gateway draining)."""
        try:
            return await self._admit(prepared, key_id)
        except BaseException as exc:
            prepared.trace.fail(exc)
            raise

    async def _admit(self, prepared: Prepared, key_id: str) -> RequestRecord:
        rid = prepared.request_id
        self._check_new(rid)
        self._check_room(1)
        record = self._inflight[rid] = RequestRecord(self.store, rid, key_id)
        try:
            await redis_call(self.store.create(rid, prompt_tokens=len(prepared.prompt),
                                               model=self.model.name, key_id=key_id))
        except BaseException as exc:
            del self._inflight[rid]
            self.metrics.request_ended(error_status(exc).grpc_code)
            raise
        return record

    async def admit_all(self, prepared: list[Prepared], key_id: str = "") -> list[RequestRecord]:
        """``admit`` each of ``prepared`` (the choices of one request), all or none: on a
        failure the ones admitted are released (recorded ABORTED), every request span ends
        failed, and it raises as ``admit``."""
        records: list[RequestRecord] = []
        try:
            self._check_room(len(prepared))
            for p in prepared:
                records.append(await self.admit(p, key_id))
        except BaseException as exc:
            for p, record in zip(prepared, records):
                self.release(p.request_id, record)
            for trace in {id(p.trace): p.trace for p in prepared}.values():
                trace.fail(exc)  # a prompt's choices share one request span
            raise
        return records

    def release(self, request_id: str, record: RequestRecord) -> asyncio.Future:
        """Forget an admitted request that will never be relayed (recorded ABORTED); the
        returned future ends when Redis has the outcome (it runs on even if not awaited)."""
        self._inflight.pop(request_id, None)
        return self._background(record.finish())

    async def relay(self, prepared: Prepared, record: RequestRecord,
                    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Stream the workers' tokens as detokenized responses; record the outcome at the end."""
        text_out = OutputProcessor(self.tokenizer, prepared.params)
        tokens = self.dispatcher.stream(self._job(prepared, record))
        clock, code = TokenClock(self.metrics, prepared.arrival_time), "CANCELLED"
        try:
            async for msg in tokens:
                if msg.num_cached_tokens:  # the worker computed the prompt itself
                    record.num_cached_tokens = msg.num_cached_tokens
                response = self._response(prepared, record, text_out, msg)
                clock.sent(len(msg.token_ids))
                yield response
                if response.finish_reason:
                    break  # a stop string: the finally below cancels the decode stream
            code = "OK"
        except asyncio.CancelledError:
            if not record.aborted or asyncio.current_task().cancelling():
                raise  # the client went away: nothing more to send
        except grpc.aio.AioRpcError as exc:  # a worker error the dispatcher did not translate
            record.error = f"{exc.code().name}: {exc.details()}"
            code = "UNAVAILABLE"
            raise Unavailable(f"worker failed: {exc.details()}") from exc
        except Exception as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            code = error_status(exc).grpc_code
            raise
        finally:
            clock.ended(code)
            record.cancel()  # no-op for finished calls; frees worker blocks otherwise
            # NOTE: shielded: a front end on anyio (Starlette) cancels a gone client's stream
            # at every await, which would drop the outcome's Redis write half done.
            await asyncio.shield(self._background(self._close(prepared, tokens, record)))
        if record.aborted:
            yield gateway_pb2.GenerateResponse(
                request_id=prepared.request_id, finish_reason="abort",
                usage=record.usage(len(prepared.prompt)))

    async def _close(self, prepared: Prepared, tokens: AsyncIterator, record: RequestRecord) -> None:
        await tokens.aclose()
        self._inflight.pop(prepared.request_id, None)
        await record.finish()
        prepared.trace.finish(record)

    def abort(self, request_id: str, key_id: str | None = None) -> bool:
        """Cancel a request in flight on this gateway; False when there is none by that id
        (or, with ``key_id``, none that API key created: others' requests look unknown)."""
        record = self._inflight.get(request_id)
        if record is None or (key_id is not None and record.key_id != key_id):
            return False
        record.abort()
        return True

    async def request_info(self, request_id: str) -> dict | None:
        """The request's Redis record (None if unknown). Raises Unavailable (Redis)."""
        return await redis_call(self.store.get(request_id))

    def _background(self, coro) -> asyncio.Future:
        """Run ``coro`` to its end even if its awaiter is cancelled (a reference is kept)."""
        task = asyncio.ensure_future(coro)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task

    def _check_room(self, count: int) -> None:
        if self.draining:
            self.metrics.request_ended("UNAVAILABLE")
            raise Unavailable("gateway is draining (shutting down); retry on another gateway")
        if len(self._inflight) + count > self.max_inflight:
            self.metrics.request_ended("RESOURCE_EXHAUSTED")
            raise ResourceExhausted(f"gateway overloaded: {self.max_inflight} requests in flight "
                                    "(--max-inflight); retry later")

    def _check_new(self, rid: str) -> None:
        if rid in self._inflight:
            raise InvalidArgument("request_id", f"{rid!r} is already in flight")

    def _response(self, prepared: Prepared, record: RequestRecord, text_out: OutputProcessor,
                  msg: worker_pb2.DecodeResponse) -> gateway_pb2.GenerateResponse:
        """Detokenize one decode message (stop strings included) and note it in the record."""
        if not record.num_output_tokens:
            prepared.trace.first_token()
        record.on_tokens(len(msg.token_ids))
        text, stopped = text_out.process(list(msg.token_ids))
        reason = "stop" if stopped else msg.finish_reason
        if reason and not stopped:
            text += text_out.flush()
        # NOTE: once per message to every client: only the fields this one has are set (an
        # empty message filled in costs a fraction of one built from keywords)
        response = gateway_pb2.GenerateResponse(request_id=prepared.request_id, text=text)
        response.token_ids.extend(msg.token_ids)
        if msg.logprobs:
            response.logprobs.extend(self._logprob(lp) for lp in msg.logprobs)
        if msg.prompt_logprobs:
            response.prompt_logprobs.extend(self._prompt_logprobs(prepared.prompt,
                                                                  msg.prompt_logprobs))
        if reason:
            record.finish_reason = response.finish_reason = reason
            response.usage.CopyFrom(record.usage(len(prepared.prompt)))
        return response

    def _job(self, prepared: Prepared, record: RequestRecord) -> Job:
        def on_dispatch(decode_worker: str, prefill_worker: str, resumed: bool) -> None:
            workers = {"decode_worker": decode_worker, "prefill_worker": prefill_worker}
            if resumed:  # a retry or migration: the record names the workers now serving it
                record.write(self.store.update(prepared.request_id, **workers))
            else:
                record.write(self.store.transition(prepared.request_id, RequestState.PREFILLING,
                                                   prefill_start_time=time.time(), **workers))

        def on_prefilled(result: worker_pb2.PrefillResponse) -> None:
            prepared.trace.prefilled(result)
            record.num_cached_tokens = result.num_cached_tokens
            record.write(self.store.update(
                prepared.request_id, prefill_end_time=time.time(),
                prefill_queue_time=result.queue_time_s, prefill_compute_time=result.compute_time_s,
                kv_transfer_time=result.transfer_time_s))

        return Job(prepared.request_id, prepared.prompt, params_to_proto(prepared.params),
                   record.track, on_dispatch, on_prefilled, prepared.trace)

    def _prompt_logprobs(self, prompt: list[int], lps) -> list[gateway_pb2.PromptLogprob]:
        """The worker's prompt logprobs (one per prompt token after the first) as one entry
        per prompt token, the first without a logprob; [] when there are none."""
        if not lps:
            return []
        if len(lps) != len(prompt) - 1:
            raise RuntimeError(f"prompt logprobs: {len(lps)} for a prompt of {len(prompt)} tokens")
        first = gateway_pb2.PromptLogprob(token_id=prompt[0], text=self._token_text(prompt[0]))
        return [first] + [gateway_pb2.PromptLogprob(**_fields(self._logprob(lp))) for lp in lps]

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprob(self, lp: worker_pb2.SampledLogprobs) -> gateway_pb2.TokenLogprob:
        decode = self._token_text
        return gateway_pb2.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob, text=decode(lp.token_id),
            top_logprobs=[gateway_pb2.TopLogprob(token_id=t, logprob=v, text=decode(t))
                          for t, v in zip(lp.top_token_ids, lp.top_logprobs)])


def _fields(lp: gateway_pb2.TokenLogprob) -> dict:
    return {"token_id": lp.token_id, "logprob": lp.logprob, "text": lp.text,
            "top_logprobs": lp.top_logprobs}
