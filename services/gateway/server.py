"""Gateway: validates and tokenizes, admits (a bounded number of requests in flight), hands the
request to the dispatcher (reserve KV on a decode worker, prefill into it, relay the decode
stream; retries and migrations: ``dispatch.py``), detokenizes incrementally, and records every
step in Redis.

Redis: a new request needs its record (UNAVAILABLE naming Redis otherwise); once admitted, a
request never fails because of Redis: its state writes run in order off the request path and
become logged warnings while Redis is away.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc
import redis

from services.api import gateway_pb2, gateway_pb2_grpc, worker_pb2
from services.engine.output_processor import OutputProcessor
from services.engine.tokenizer import Tokenizer
from services.gateway import validation
from services.gateway.dispatch import Dispatcher, Job
from services.gateway.routing import WorkerPool
from services.rpc import ResourceExhausted, Unavailable
from services.state.store import RequestState, RequestStateStore
from services.api.convert import params_to_proto

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """What Abort must cancel for one request, and its Redis writes (kept in order)."""

    calls: list = field(default_factory=list)  # grpc.aio calls and tasks to this request's workers
    aborted: bool = False
    writes: asyncio.Future | None = None  # the latest queued Redis write

    def track(self, call):
        self.calls = [c for c in self.calls if not c.done()]
        self.calls.append(call)
        if self.aborted:
            call.cancel()
        return call

    def cancel(self) -> None:
        for c in self.calls:
            c.cancel()


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 store: RequestStateStore, pool: WorkerPool, rpc_timeout_s: float,
                 kv_failure_policy: str = "recompute", max_inflight: int = 1024) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.store = store
        self.pool = pool
        self.max_inflight = max_inflight
        self.dispatcher = Dispatcher(pool, rpc_timeout_s, kv_failure_policy)
        self._inflight: dict[str, _InFlight] = {}

    async def close(self) -> None:
        await self.pool.close()

    # -- public RPCs -------------------------------------------------------------------------
    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        if request.model and request.model != self.model_name:
            raise ValueError(f"model: {request.model!r} is not served here (serving {self.model_name!r})")
        rid = request.request_id or uuid.uuid4().hex
        if rid in self._inflight:
            raise ValueError(f"request_id: {rid!r} is already in flight")
        prompt = validation.prompt_token_ids(request, self.tokenizer, self.max_model_len)
        params = validation.sampling_params(request, len(prompt), self.max_model_len)
        if len(self._inflight) >= self.max_inflight:
            raise ResourceExhausted(f"gateway overloaded: {self.max_inflight} requests in flight "
                                    "(--max-inflight); retry later")
        inflight = self._inflight[rid] = _InFlight()
        try:
            await _redis(self.store.create(rid, prompt_tokens=len(prompt), model=self.model_name))
        except BaseException:
            del self._inflight[rid]
            raise
        text_out = OutputProcessor(self.tokenizer, params)
        n_out, state, fields = 0, RequestState.FAILED, {}
        run = self.dispatcher.stream(self._job(rid, prompt, params, inflight))
        try:
            async for msg in run:
                if n_out == 0:
                    self._write(inflight, self.store.transition(
                        rid, RequestState.DECODING, first_token_time=time.time()))
                n_out += len(msg.token_ids)
                text, stopped = text_out.process(list(msg.token_ids))
                reason = "stop" if stopped else msg.finish_reason
                if reason and not stopped:
                    text += text_out.flush()
                yield gateway_pb2.GenerateResponse(
                    request_id=rid, token_ids=msg.token_ids, text=text, finish_reason=reason,
                    usage=_usage(len(prompt), n_out) if reason else None,
                    logprobs=[self._logprob(lp) for lp in msg.logprobs])
                if reason:  # "abort": a worker's Abort ended it
                    state = RequestState.ABORTED if reason == "abort" else RequestState.FINISHED
                    fields = {"finish_reason": reason}
                    break  # a stop string: the finally below cancels the decode stream
        except asyncio.CancelledError:
            state, fields = RequestState.ABORTED, {"finish_reason": "abort"}
            if not inflight.aborted or asyncio.current_task().cancelling():
                raise  # the client went away: nothing more to send
        except GeneratorExit:  # the client went away while a message was on its way
            state, fields = RequestState.ABORTED, {"finish_reason": "abort"}
            raise
        except grpc.aio.AioRpcError as exc:  # a worker error the dispatcher did not translate
            fields = {"error": f"{exc.code().name}: {exc.details()}"}
            raise Unavailable(f"worker failed: {exc.details()}") from exc
        except Exception as exc:
            fields = {"error": f"{type(exc).__name__}: {exc}"}
            raise
        finally:
            inflight.cancel()  # no-op for finished calls; frees worker blocks otherwise
            await run.aclose()
            self._inflight.pop(rid, None)
            if inflight.aborted:
                state, fields = RequestState.ABORTED, {"finish_reason": "abort"}
            await self._flush(inflight)
            await _redis(self.store.transition(rid, state, output_tokens=n_out, **fields),
                         raise_=False)
        if inflight.aborted:
            yield gateway_pb2.GenerateResponse(request_id=rid, finish_reason="abort",
                                               usage=_usage(len(prompt), n_out))

    def _job(self, rid: str, prompt: list[int], params, inflight: _InFlight) -> Job:
        def on_dispatch(decode_worker: str, prefill_worker: str, resumed: bool) -> None:
            workers = {"decode_worker": decode_worker, "prefill_worker": prefill_worker}
            if resumed:  # a retry or migration: the record names the workers now serving it
                self._write(inflight, self.store.update(rid, **workers))
            else:
                self._write(inflight, self.store.transition(
                    rid, RequestState.PREFILLING, prefill_start_time=time.time(), **workers))

        def on_prefilled() -> None:
            self._write(inflight, self.store.update(rid, prefill_end_time=time.time()))

        return Job(rid, prompt, params_to_proto(params), inflight.track, on_dispatch, on_prefilled)

    def _write(self, inflight: _InFlight, coro) -> None:
        """Queue a Redis write of an admitted request after its earlier ones (best effort)."""
        previous = inflight.writes

        async def write():
            if previous is not None:
                await asyncio.wait({previous})
            await _redis(coro, raise_=False)

        inflight.writes = asyncio.ensure_future(write())

    async def _flush(self, inflight: _InFlight) -> None:
        if inflight.writes is not None:
            await asyncio.wait({inflight.writes})

    def _logprob(self, lp: worker_pb2.SampledLogprobs) -> gateway_pb2.TokenLogprob:
        decode = lambda t: self.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
        return gateway_pb2.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob, text=decode(lp.token_id),
            top_logprobs=[gateway_pb2.TopLogprob(token_id=t, logprob=v, text=decode(t))
                          for t, v in zip(lp.top_token_ids, lp.top_logprobs)])

    async def Abort(self, request: gateway_pb2.AbortRequest, context):
        inflight = self._inflight.get(request.request_id)
        if inflight is None:
            return gateway_pb2.AbortResponse(found=False)
        inflight.aborted = True
        inflight.cancel()
        return gateway_pb2.AbortResponse(found=True)

    async def GetRequest(self, request: gateway_pb2.GetRequestRequest, context):
        info = await _redis(self.store.get(request.request_id))
        if info is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: {request.request_id!r} is unknown")
        info["status"] = str(info["status"]).upper()
        return gateway_pb2.RequestInfo(request_id=request.request_id, **info)


async def _redis(coro, raise_: bool = True):
    """Await a Redis operation. Unreachable Redis: UNAVAILABLE naming it, or with ``raise_``
    False a logged warning (as is a record gone missing, e.g. after Redis restarted empty)."""
    try:
        return await coro
    except (redis.RedisError, OSError, TimeoutError) as exc:
        if raise_:
            raise Unavailable(f"request-state store (Redis) unreachable: {exc}") from exc
        log.warning("request-state store (Redis) write failed: %s", exc)
    except KeyError as exc:
        if raise_:
            raise ValueError(f"request_id: {exc.args[0]}") from None
        log.warning("request-state store (Redis): %s", exc.args[0])


def _usage(prompt_tokens: int, completion_tokens: int) -> gateway_pb2.Usage:
    return gateway_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                             total_tokens=prompt_tokens + completion_tokens)
