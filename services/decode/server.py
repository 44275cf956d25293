"""Decode worker: reserves KV blocks for a prompt, admits the sequence into its running batch
once a prefill worker has written the prompt's KV, and streams every output token."""
from __future__ import annotations

import asyncio
import json
import logging
import time

from services.api import worker_pb2, worker_pb2_grpc
from services.engine.request import Request
from services.engine.scheduler import RequestOutput
from services.kv_transfer import create_transport
from services.rpc import ResourceExhausted
from services.engine.sampler import TokenLogprobs
from services.worker import WorkerRuntime, logprobs_to_proto, params_from_proto

log = logging.getLogger(__name__)


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime
        opts = runtime.options
        engine = runtime.engine
        self.transport = create_transport(
            opts.kv_transport, engine.kv_cache, engine.layout,
            host=opts.host, port=opts.kv_port, advertise_host=opts.advertise_host,
        )
        self.transport.set_notification_handler(self._on_kv_arrived)
        self.Abort = runtime.Abort
        self.GetLoad = runtime.GetLoad

    def close(self) -> None:
        self.transport.close()

    def _on_kv_arrived(self, notification: bytes) -> None:
        """Transport thread: the prompt's KV is in our blocks; admit it at the next step."""
        note = json.loads(notification)
        request_id, first_token = note["request_id"], int(note["first_token_id"])
        logprobs = TokenLogprobs.from_dict(note["logprobs"]) if note.get("logprobs") else None

        def admit(engine):
            out = engine.finish_remote_prefill(request_id, first_token, logprobs)
            if out is not None:
                self.rt._on_outputs([out])

        self.rt.engine_loop.call(admit)

    async def Decode(self, request: worker_pb2.DecodeRequest, context):
        rid = request.request_id
        params = params_from_proto(request.sampling_params)
        queue = self.rt.open_stream(rid)
        finished = False
        try:
            req: Request = await self.rt.call(
                lambda e: e.make_request(rid, list(request.prompt_token_ids), params))
            if request.local_prefill:
                await self.rt.call(lambda e: e.add_request(req))
                deadline = None
            else:
                if not await self.rt.call(lambda e: e.reserve(req)):
                    raise ResourceExhausted(f"decode worker {self.rt.worker_id}: not enough free KV "
                                            f"blocks for {req.num_prompt_tokens} prompt tokens")
                lease = self.rt.options.kv_lease_s
                yield worker_pb2.DecodeResponse(reservation=worker_pb2.KVReservation(
                    worker_id=self.rt.worker_id, transport=self.rt.options.kv_transport,
                    transport_metadata=self.transport.metadata(),
                    block_ids=list(req.block_table), lease_s=lease))
                deadline = time.monotonic() + lease
            async for outs in _batches(queue, deadline):
                last = outs[-1]
                finished = last.finish_reason is not None
                yield worker_pb2.DecodeResponse(
                    token_ids=[t for o in outs for t in o.new_token_ids],
                    finish_reason=last.finish_reason or "", num_output_tokens=last.num_output_tokens,
                    logprobs=[logprobs_to_proto(lp) for o in outs for lp in o.logprobs or ()])
                if finished:
                    return
        finally:  # client gone, lease expired or error: free whatever the request holds
            await self.rt.close_stream(rid, abort=not finished)


async def _batches(queue: asyncio.Queue[RequestOutput], deadline: float | None):
    """Yield every output queued so far as one list; the first wait ends at ``deadline``
    (the reservation's lease) with TimeoutError."""
    while True:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            try:
                first = await asyncio.wait_for(queue.get(), max(remaining, 0.0))
            except TimeoutError:
                raise TimeoutError("the prompt's KV did not arrive within the reservation's lease")
            deadline = None
        else:
            first = await queue.get()
        outs = [first]
        while not queue.empty() and outs[-1].finish_reason is None:
            outs.append(queue.get_nowait())
        yield outs
