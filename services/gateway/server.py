"""Gateway: validates and tokenizes, reserves KV on a decode worker, dispatches the prompt to
a prefill worker that writes its KV into the reservation, relays the decode worker's token
stream (detokenized incrementally), and records every step in Redis."""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass, field

import grpc
import redis

from services.api import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.engine.output_processor import OutputProcessor
from services.engine.tokenizer import Tokenizer
from services.gateway import validation
from services.rpc import ResourceExhausted, Unavailable
from services.state.registry import WorkerInfo, WorkerRegistry
from services.state.store import RequestState, RequestStateStore
from services.worker import params_to_proto

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """What Abort must cancel for one request."""

    calls: list = field(default_factory=list)  # grpc.aio calls and tasks to this request's workers
    aborted: bool = False

    def cancel(self) -> None:
        for c in self.calls:
            c.cancel()


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 store: RequestStateStore, registry: WorkerRegistry, rpc_timeout_s: float) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.store = store
        self.registry = registry
        self.rpc_timeout_s = rpc_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._inflight: dict[str, _InFlight] = {}

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        if endpoint not in self._channels:
            self._channels[endpoint] = grpc.aio.insecure_channel(endpoint)
        return self._channels[endpoint]

    # -- public RPCs -------------------------------------------------------------------------
    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        if request.model and request.model != self.model_name:
            raise ValueError(f"model: {request.model!r} is not served here (serving {self.model_name!r})")
        rid = request.request_id or uuid.uuid4().hex
        if rid in self._inflight:
            raise ValueError(f"request_id: {rid!r} is already in flight")
        prompt = validation.prompt_token_ids(request, self.tokenizer, self.max_model_len)
        params = validation.sampling_params(request, len(prompt), self.max_model_len)
        await self._record(self.store.create(rid, prompt_tokens=len(prompt), model=self.model_name))
        inflight = self._inflight[rid] = _InFlight()
        text_out = OutputProcessor(self.tokenizer, params)
        n_out, state, fields = 0, RequestState.FAILED, {}
        run = self._run(rid, prompt, params, inflight)
        try:
            async for msg in run:
                n_out += len(msg.token_ids)
                text, stopped = text_out.process(list(msg.token_ids))
                reason = "stop" if stopped else msg.finish_reason
                if reason and not stopped:
                    text += text_out.flush()
                yield gateway_pb2.GenerateResponse(
                    request_id=rid, token_ids=msg.token_ids, text=text, finish_reason=reason,
                    usage=_usage(len(prompt), n_out) if reason else None,
                    logprobs=[self._logprob(lp) for lp in msg.logprobs])
                if reason:
                    state, fields = RequestState.FINISHED, {"finish_reason": reason}
                    break  # a stop string: the finally below cancels the decode stream
        except asyncio.CancelledError:
            state = RequestState.ABORTED
            if not inflight.aborted or asyncio.current_task().cancelling():
                raise  # the client went away: nothing more to send
        except grpc.aio.AioRpcError as exc:
            if not inflight.aborted:
                fields = {"error": f"{exc.code().name}: {exc.details()}"}
                raise Unavailable(f"worker failed: {exc.details()}") from exc
        except Exception as exc:
            fields = {"error": str(exc)}
            raise
        finally:
            inflight.cancel()  # no-op for finished calls; frees worker blocks otherwise
            await run.aclose()
            self._inflight.pop(rid, None)
            if inflight.aborted:
                state, fields = RequestState.ABORTED, {"finish_reason": "abort"}
            await self._record(self.store.transition(rid, state, output_tokens=n_out, **fields),
                               raise_=False)
        if inflight.aborted:
            yield gateway_pb2.GenerateResponse(request_id=rid, finish_reason="abort",
                                               usage=_usage(len(prompt), n_out))

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
        info = await self._record(self.store.get(request.request_id))
        if info is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: {request.request_id!r} is unknown")
        info["status"] = str(info["status"]).upper()
        return gateway_pb2.RequestInfo(request_id=request.request_id, **info)

    # -- the request's path ------------------------------------------------------------------
    async def _run(self, rid: str, prompt: list[int], params, inflight: _InFlight):
        """Yield the decode worker's DecodeResponse messages that carry tokens."""
        sp = params_to_proto(params)
        decode, reservation, d_info = await self._reserve(rid, prompt, sp, inflight)
        p_info = await self._pick("prefill")
        await self._record(self.store.transition(
            rid, RequestState.PREFILLING, decode_worker=d_info.worker_id,
            prefill_worker=p_info.worker_id, prefill_start_time=time.time()))
        prefill = asyncio.ensure_future(self._prefill(p_info, worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling_params=sp, destination=reservation)))
        inflight.calls.append(prefill)
        first_msg = asyncio.ensure_future(decode.read())
        done, _ = await asyncio.wait({first_msg, prefill}, return_when=asyncio.FIRST_COMPLETED)
        if prefill in done and prefill.exception() is not None:
            first_msg.cancel()
            raise prefill.exception()
        msg = await first_msg
        await self._record(self.store.transition(rid, RequestState.DECODING, first_token_time=time.time()))
        while msg is not grpc.aio.EOF:
            yield msg
            if msg.finish_reason:
                break
            msg = await decode.read()
        await prefill

    async def _prefill(self, worker: WorkerInfo, request: worker_pb2.PrefillRequest):
        stub = worker_pb2_grpc.PrefillWorkerStub(self._channel(worker.endpoint))
        result = await stub.Prefill(request, timeout=self.rpc_timeout_s)
        await self._record(self.store.update(request.request_id, prefill_end_time=time.time()),
                           raise_=False)
        return result

    async def _reserve(self, rid, prompt, sp, inflight):
        """Open a Decode stream on the least loaded decode worker that has room for the prompt."""
        workers = await self._workers("decode")
        workers.sort(key=lambda w: (-w.free_kv_blocks, w.num_running))
        for w in workers:
            call = worker_pb2_grpc.DecodeWorkerStub(self._channel(w.endpoint)).Decode(
                worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp),
                timeout=self.rpc_timeout_s)
            inflight.calls.append(call)
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                    continue
                raise
            if first is grpc.aio.EOF or not first.HasField("reservation"):
                raise RuntimeError(f"decode worker {w.worker_id} answered without a reservation")
            return call, first.reservation, w
        raise ResourceExhausted("no decode worker has room for this request; retry later")

    async def _pick(self, role: str) -> WorkerInfo:
        workers = await self._workers(role)
        return min(workers, key=lambda w: w.num_waiting + w.num_running)

    async def _workers(self, role: str) -> list[WorkerInfo]:
        workers = await self._record(self.registry.list(role))
        if not workers:
            raise Unavailable(f"no {role} worker is registered")
        random.shuffle(workers)  # spread ties
        return workers

    async def _record(self, coro, raise_: bool = True):
        """Await a Redis operation; unreachable Redis becomes UNAVAILABLE (or a logged warning)."""
        try:
            return await coro
        except (redis.RedisError, OSError) as exc:
            if raise_:
                raise Unavailable(f"request-state store (Redis) unreachable: {exc}") from exc
            log.warning("request-state store (Redis) write failed: %s", exc)


def _usage(prompt_tokens: int, completion_tokens: int) -> gateway_pb2.Usage:
    return gateway_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                             total_tokens=prompt_tokens + completion_tokens)
