"""Prefill worker: batches prompts (chunked prefill under a token budget), computes each
prompt's KV and first token, writes the KV into the decode worker's reserved blocks with a
notification carrying the first token, then frees its own blocks."""
from __future__ import annotations

import asyncio
import json
import logging
import time

from services.api import worker_pb2, worker_pb2_grpc
from services.kv_transfer import create_transport
from services.worker import WorkerRuntime, params_from_proto

log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, runtime: WorkerRuntime, transfer_timeout_s: float = 30.0) -> None:
        self.rt = runtime
        opts = runtime.options
        engine = runtime.engine
        # a sender only: its listener is never written to, but costs nothing
        self.transport = create_transport(
            opts.kv_transport, engine.kv_cache, engine.layout,
            host=opts.host, port=0, advertise_host=opts.advertise_host,
        )
        self.transfer_timeout_s = transfer_timeout_s
        self.Abort = runtime.Abort
        self.GetLoad = runtime.GetLoad

    def close(self) -> None:
        self.transport.close()

    async def Prefill(self, request: worker_pb2.PrefillRequest, context):
        rid = request.request_id
        dest = request.destination
        if dest.transport != self.rt.options.kv_transport:
            raise ValueError(f"destination.transport: {dest.transport!r}, this worker sends "
                             f"with {self.rt.options.kv_transport!r}")
        # the prefill worker samples only the first token; the decode worker decides stopping
        params = params_from_proto(request.sampling_params).model_copy(update={"max_tokens": 1})
        t_arrival = time.monotonic()
        queue = self.rt.open_stream(rid)
        held = False
        try:
            req = await self.rt.call(lambda e: e.make_request(
                rid, list(request.prompt_token_ids), params, hold_kv=True))
            n_blocks = self.rt.engine.block_manager.blocks_needed(req.num_prompt_tokens)
            if len(dest.block_ids) != n_blocks:
                raise ValueError(f"destination.block_ids: {len(dest.block_ids)} blocks for "
                                 f"{req.num_prompt_tokens} prompt tokens, expected {n_blocks}")
            await self.rt.call(lambda e: e.add_request(req))
            held = True
            out = await queue.get()
            t_first = time.monotonic()
            first_token = out.new_token_ids[0]
            peer = await asyncio.to_thread(self.transport.add_remote, dest.transport_metadata)
            note = json.dumps({"request_id": rid, "first_token_id": first_token,
                               "logprobs": out.logprobs[0].to_dict() if out.logprobs else None}).encode()
            await asyncio.to_thread(
                self.transport.write_blocks, peer, req.block_table[:n_blocks],
                list(dest.block_ids), note, self.transfer_timeout_s)
            t_done = time.monotonic()
        finally:
            self.rt.streams.pop(rid, None)
            if held:  # finished (blocks held for the transfer) or still running: free either way
                await self.rt.call(lambda e: e.abort(rid))
        return worker_pb2.PrefillResponse(
            worker_id=self.rt.worker_id, first_token_id=first_token,
            queue_time_s=req.first_scheduled_time - t_arrival,
            compute_time_s=t_first - req.first_scheduled_time, transfer_time_s=t_done - t_first)
