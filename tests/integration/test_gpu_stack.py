"""The disaggregated stack on one GPU (issue 37): a prefill and decode workers sharing the device,
KV handed over by CUDA IPC (the TCP transport's direct writes). Greedy output in the fp32 oracle
mode equals transformers' (fp32 on the GPU measured token-exact against the CPU oracle,
docs/benchmarks.md); an aborted stream and a killed decode worker leave no KV block in use, and
the killed worker's streams migrate and finish as uninterrupted ones. Skipped without a GPU (CI);
`scripts/gpu_checks.sh c` runs it on a lent one.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from services.api import gateway_pb2, gateway_pb2_grpc
from services.runtime.launcher import Stack, UpOptions
from tests.integration.conftest import assert_all_blocks_freed, free_port, running, wait_until
from tests.integration.test_stack import chat_request, generate
from tests.reference import CHAT_PROMPTS, NUM_TOKENS, hf_greedy_outputs

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GPU_WORKER_ARGS = ["--device", "cuda", "--num-threads", "1", "--kv-cache-gib", "1",
                   "--heartbeat-s", "0.5"]


@pytest.fixture(scope="module")
def gpu_stack():
    """One prefill and two decode workers on the GPU (float32, the oracle mode)."""
    with running(Stack(UpOptions(host="127.0.0.1", port=free_port(), num_prefill=1,
                                 num_decode=2, redis_url=None, worker_args=GPU_WORKER_ARGS,
                                 gateway_args=["--heartbeat-s", "0.5"],
                                 ready_timeout_s=300))) as s:
        yield s


def test_greedy_matches_transformers_through_a_gpu_stack(gpu_stack):
    for prompt, expected in zip(CHAT_PROMPTS, hf_greedy_outputs()):
        tokens, _, last = asyncio.run(generate(gpu_stack.address, chat_request(prompt)))
        assert tokens == list(expected), prompt
        assert last.finish_reason == "length" and last.usage.completion_tokens == NUM_TOKENS
    asyncio.run(assert_all_blocks_freed(gpu_stack, timeout_s=10))


def test_abort_mid_stream_frees_every_block_on_the_gpu(gpu_stack):
    async def run():
        async with grpc.aio.insecure_channel(gpu_stack.address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            call = stub.Generate(chat_request(CHAT_PROMPTS[2], request_id="gpu-abort",
                                              max_tokens=2000))
            assert (await call.read()).token_ids
            assert (await stub.Abort(gateway_pb2.AbortRequest(request_id="gpu-abort"))).found
            msgs = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                msgs.append(msg)
            assert msgs[-1].finish_reason == "abort"
        await assert_all_blocks_freed(gpu_stack, timeout_s=10)

    asyncio.run(run())


def test_a_killed_decode_worker_s_streams_migrate_and_leave_no_block(gpu_stack):
    """Kill the decode worker serving a stream mid-way: every stream finishes with the tokens of
    an uninterrupted run of the same requests, and the workers left hold no KV block."""
    prompts, max_tokens = CHAT_PROMPTS[:4], 512

    async def run():
        async with grpc.aio.insecure_channel(gpu_stack.address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)

            async def stream(request, progress):
                async for msg in stub.Generate(request, timeout=300):
                    progress.extend(msg.token_ids)
                return msg

            def requests(tag):
                return [chat_request(p, request_id=f"gpu-{tag}-{i}", max_tokens=max_tokens)
                        for i, p in enumerate(prompts)]

            reference = [[] for _ in prompts]
            await asyncio.gather(*(stream(r, reference[i]) for i, r in enumerate(requests("ref"))))
            progress = [[] for _ in prompts]
            calls = [asyncio.ensure_future(stream(r, progress[i]))
                     for i, r in enumerate(requests("kill"))]
            await wait_until(lambda: _async(min(len(p) for p in progress) >= 4), 120,
                             "every stream started", poll_s=0.005)
            info = await stub.GetRequest(gateway_pb2.GetRequestRequest(request_id="gpu-kill-0"))
            gpu_stack.process(info.decode_worker).kill()
            assert len(progress[0]) < max_tokens, "decoding finished before the kill"
            lasts = await asyncio.gather(*calls)
        for got, expected, last in zip(progress, reference, lasts):
            assert got == expected and len(got) == max_tokens and last.finish_reason == "length"
        await assert_all_blocks_freed(gpu_stack, timeout_s=30)

    asyncio.run(run())


async def _async(value):
    return value
