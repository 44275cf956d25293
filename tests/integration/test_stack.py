"""The whole request path on the real model: gateway -> prefill -> TCP KV handoff -> decode."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import redis.asyncio as aioredis

from services.api import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.state.registry import WorkerRegistry
from tests.reference import CHAT_PROMPTS, NUM_TOKENS, hf_greedy_outputs

pytestmark = pytest.mark.integration


def chat_request(prompt: str, **options) -> gateway_pb2.GenerateRequest:
    fields = dict(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    fields.update(options)
    return gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role="user", content=prompt)], **fields)


async def generate(address: str, request: gateway_pb2.GenerateRequest):
    """Returns (token ids, text, last message) of one streamed request."""
    async with grpc.aio.insecure_channel(address) as channel:
        tokens, text, last = [], [], None
        async for msg in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=300):
            tokens.extend(msg.token_ids)
            text.append(msg.text)
            last = msg
        return tokens, "".join(text), last


def test_greedy_matches_transformers_through_the_stack(stack):
    reference = hf_greedy_outputs()
    for prompt, expected in zip(CHAT_PROMPTS, reference):
        tokens, text, last = asyncio.run(generate(stack.address, chat_request(prompt, request_id=f"seq-{prompt[:12]}")))
        assert tokens == list(expected), prompt
        assert last.finish_reason == "length"
        assert last.usage.completion_tokens == NUM_TOKENS
        assert text


def test_concurrent_streams_equal_single_request_outputs(stack):
    reference = hf_greedy_outputs()
    prompts = [(i, p) for i, p in enumerate(CHAT_PROMPTS)] * 2  # 16 concurrent requests

    async def run_all():
        return await asyncio.gather(*(generate(stack.address, chat_request(p, request_id=f"conc-{n}"))
                                      for n, (_, p) in enumerate(prompts)))

    results = asyncio.run(run_all())
    for (i, prompt), (tokens, _, last) in zip(prompts, results):
        assert tokens == list(reference[i]), prompt
        assert last.finish_reason == "length"


def test_blocks_freed_and_state_recorded(stack, redis_server):
    asyncio.run(generate(stack.address, chat_request(CHAT_PROMPTS[0], request_id="recorded")))

    async def check():
        client = aioredis.Redis.from_url(redis_server.url)
        workers = [w for role in ("prefill", "decode") for w in await WorkerRegistry(client).list(role)]
        await client.aclose()
        assert {w.role for w in workers} == {"prefill", "decode"}
        for w in workers:
            async with grpc.aio.insecure_channel(w.endpoint) as ch:
                stub_cls = worker_pb2_grpc.DecodeWorkerStub if w.role == "decode" else worker_pb2_grpc.PrefillWorkerStub
                load = await stub_cls(ch).GetLoad(worker_pb2.GetLoadRequest())
            assert load.free_kv_blocks == load.total_kv_blocks > 0, w
            assert load.num_running == load.num_waiting == 0
        async with grpc.aio.insecure_channel(stack.address) as ch:
            info = await gateway_pb2_grpc.GatewayStub(ch).GetRequest(
                gateway_pb2.GetRequestRequest(request_id="recorded"))
        assert info.status == "FINISHED"
        assert info.finish_reason == "length"
        assert info.prefill_worker == "prefill-0" and info.decode_worker == "decode-0"
        assert info.output_tokens == NUM_TOKENS
        assert 0 < info.arrival_time <= info.prefill_start_time <= info.first_token_time <= info.finish_time
        assert info.prefill_start_time <= info.prefill_end_time <= info.finish_time

    asyncio.run(check())


BAD_INPUTS = [
    ("empty prompt", gateway_pb2.GenerateRequest(prompt=""), "prompt"),
    ("prompt longer than the context", gateway_pb2.GenerateRequest(prompt="hello " * 9000), "prompt"),
    ("max_tokens zero", gateway_pb2.GenerateRequest(prompt="hi", max_tokens=0), "max_tokens"),
    ("max_tokens negative", gateway_pb2.GenerateRequest(prompt="hi", max_tokens=-5), "max_tokens"),
    ("temperature negative", gateway_pb2.GenerateRequest(prompt="hi", temperature=-0.5), "temperature"),
    ("top_p zero", gateway_pb2.GenerateRequest(prompt="hi", top_p=0.0), "top_p"),
    ("top_p above one", gateway_pb2.GenerateRequest(prompt="hi", top_p=1.5), "top_p"),
    ("unknown model", gateway_pb2.GenerateRequest(prompt="hi", model="gpt-9"), "model"),
    ("bad role", gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="robot", content="x")]),
     "messages[0].role"),
]


@pytest.mark.parametrize("case,request_,field", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_invalid_argument_naming_the_field(stack, case, request_, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(generate(stack.address, request_))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()


def test_stack_keeps_serving_after_bad_input(stack):
    tokens, _, last = asyncio.run(generate(stack.address, chat_request(CHAT_PROMPTS[0], max_tokens=8)))
    assert tokens == list(hf_greedy_outputs()[0][:8])
    assert last.finish_reason == "length"


def test_seeded_sampling_through_the_stack_equals_a_unified_run(stack):
    from services.engine.llm import LLM
    from services.engine.sampling_params import SamplingParams

    request = chat_request(CHAT_PROMPTS[1], temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    tokens, _, _ = asyncio.run(generate(stack.address, request))
    llm = LLM(num_kv_blocks=64)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    expected = llm.chat([[{"role": "user", "content": CHAT_PROMPTS[1]}]], params)[0].token_ids
    assert tokens == expected
    assert tokens != list(hf_greedy_outputs()[1][:24])  # it really sampled
