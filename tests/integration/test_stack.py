"""The whole request path on the real model: gateway -> prefill -> KV handoff (TCP, and NIXL
for the oracle test) -> decode."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import redis.asyncio as aioredis

from services.api import gateway_pb2, gateway_pb2_grpc
from services.state.registry import WorkerRegistry
from services.state.store import RequestState, RequestStateStore
from tests.integration.conftest import WORKER_ARGS, assert_all_blocks_freed, start_stack, wait_until
from tests.reference import CHAT_PROMPTS, NUM_TOKENS, compute_hf_greedy_outputs, hf_greedy_outputs
from tests.unit.nixl_install import require_nixl

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


def test_stored_reference_is_what_transformers_computes():
    """The stored oracle (tests/data/hf_greedy.json) is transformers' output today."""
    assert compute_hf_greedy_outputs() == hf_greedy_outputs()


@pytest.fixture(params=["tcp", "nixl"])
def transport_stack(request):
    """The module's TCP stack, or a stack of its own whose workers hand KV off over NIXL
    (its own Redis; skipped only when the NIXL package is not installed at all)."""
    if request.param == "tcp":
        yield request.getfixturevalue("stack")
        return
    require_nixl()
    s = start_stack([*WORKER_ARGS, "--kv-transport", "nixl"], redis_url=None)
    try:
        yield s
    finally:
        s.stop()


def test_greedy_matches_transformers_through_the_stack(transport_stack):
    reference = hf_greedy_outputs()
    for prompt, expected in zip(CHAT_PROMPTS, reference):
        tokens, text, last = asyncio.run(generate(transport_stack.address,
                                                  chat_request(prompt, request_id=f"seq-{prompt[:12]}")))
        assert tokens == list(expected), prompt
        assert last.finish_reason == "length"
        assert last.usage.completion_tokens == NUM_TOKENS
        assert text
    asyncio.run(assert_all_blocks_freed(transport_stack, timeout_s=10))


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
        # the stream has ended; the workers free the blocks as the end reaches their engines
        await assert_all_blocks_freed(stack, timeout_s=10)
        async with grpc.aio.insecure_channel(stack.address) as ch:
            info = await gateway_pb2_grpc.GatewayStub(ch).GetRequest(
                gateway_pb2.GetRequestRequest(request_id="recorded"))
        assert info.status == "FINISHED"
        assert info.finish_reason == "length"
        assert info.prefill_worker == "prefill-0" and info.decode_worker == "decode-0"
        assert info.output_tokens == NUM_TOKENS
        assert 0 < info.arrival_time <= info.prefill_start_time <= info.first_token_time <= info.finish_time
        assert info.prefill_start_time <= info.prefill_end_time <= info.finish_time
        client = aioredis.Redis.from_url(redis_server.url)
        store = RequestStateStore(client)
        for n in range(16):  # the concurrent requests of the test above
            rec = await store.get(f"conc-{n}")
            assert rec["status"] == RequestState.FINISHED and rec["output_tokens"] == NUM_TOKENS
            assert rec["arrival_time"] <= rec["first_token_time"] <= rec["finish_time"]
            assert rec["decode_worker"] == "decode-0" and rec["prefill_worker"] == "prefill-0"
        await client.aclose()

    asyncio.run(check())


def test_a_one_token_request_records_its_prefill(stack):
    """The stream of a one-token request ends as soon as the KV landed, possibly before the
    prefill worker's answer: its prefill and transfer timings are in the record all the same."""
    async def run():
        async with grpc.aio.insecure_channel(stack.address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            for i in range(4):
                rid = f"one-token-{i}"
                tokens, _, last = await generate(stack.address, chat_request(
                    CHAT_PROMPTS[i], request_id=rid, max_tokens=1))
                assert len(tokens) == 1 and last.finish_reason == "length"
                info = await stub.GetRequest(gateway_pb2.GetRequestRequest(request_id=rid))
                assert info.prefill_end_time >= info.prefill_start_time > 0, info
                assert info.prefill_compute_time > 0 and info.kv_transfer_time > 0, info

    asyncio.run(run())


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
    ("min_p above one", gateway_pb2.GenerateRequest(prompt="hi", min_p=1.5), "min_p"),
    ("presence_penalty", gateway_pb2.GenerateRequest(prompt="hi", presence_penalty=3), "presence_penalty"),
    ("frequency_penalty", gateway_pb2.GenerateRequest(prompt="hi", frequency_penalty=-2.5), "frequency_penalty"),
    ("repetition_penalty zero", gateway_pb2.GenerateRequest(prompt="hi", repetition_penalty=0), "repetition_penalty"),
    ("top_logprobs too many", gateway_pb2.GenerateRequest(prompt="hi", logprobs=True, top_logprobs=25), "top_logprobs"),
    ("top_logprobs alone", gateway_pb2.GenerateRequest(prompt="hi", top_logprobs=2), "top_logprobs"),
    ("empty stop string", gateway_pb2.GenerateRequest(prompt="hi", stop=[""]), "stop"),
    ("min_tokens above max", gateway_pb2.GenerateRequest(prompt="hi", min_tokens=9, max_tokens=4), "min_tokens"),
    ("top_k below -1", gateway_pb2.GenerateRequest(prompt="hi", top_k=-2), "top_k"),
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


def test_abort_mid_stream_ends_the_stream_and_frees_blocks(stack):
    async def run():
        async with grpc.aio.insecure_channel(stack.address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            call = stub.Generate(chat_request(CHAT_PROMPTS[2], request_id="to-abort", max_tokens=2000))
            first = await call.read()
            assert first.token_ids
            assert (await stub.Abort(gateway_pb2.AbortRequest(request_id="to-abort"))).found
            msgs = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                msgs.append(msg)
            assert msgs[-1].finish_reason == "abort"
            assert sum(len(m.token_ids) for m in msgs) < 2000
            assert not (await stub.Abort(gateway_pb2.AbortRequest(request_id="to-abort"))).found
            await assert_all_blocks_freed(stack, timeout_s=10)  # as the cancellation reaches them

            async def recorded():
                info = await stub.GetRequest(gateway_pb2.GetRequestRequest(request_id="to-abort"))
                return info if info.status == "ABORTED" else None
            info = await wait_until(recorded, 10, "to-abort recorded ABORTED")
            assert info.finish_reason == "abort"

    asyncio.run(run())


def test_health_and_reflection_on_every_service(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def services_of(endpoint: str) -> set[str]:
        async with grpc.aio.insecure_channel(endpoint) as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stream = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            async for resp in stream:
                return {s.name for s in resp.list_services_response.service}

    async def check():
        client = aioredis.Redis.from_url(stack.redis_url)
        registry = WorkerRegistry(client)
        endpoints = {"tandem.v1.Gateway": stack.address}
        for role, name in (("decode", "tandem.v1.DecodeWorker"), ("prefill", "tandem.v1.PrefillWorker")):
            endpoints[name] = (await registry.list(role))[0].endpoint
        await client.aclose()
        for name, endpoint in endpoints.items():
            names = await services_of(endpoint)
            assert {name, "grpc.health.v1.Health"} <= names, names

    asyncio.run(check())


def test_tandem_chat_client(stack):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "services.runtime.cli", "chat", "What is the capital of France?",
                           "--address", stack.address, "--temperature", "0", "--max-tokens", "12"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "finish_reason=" in proc.stdout


def test_sampling_options_through_the_stack_equal_the_in_process_engine(stack):
    from services.engine.llm import LLM
    from services.engine.sampling_params import SamplingParams

    llm = LLM(num_kv_blocks=64)
    chat = [{"role": "user", "content": CHAT_PROMPTS[6]}]
    cases = [
        (dict(temperature=0.0, max_tokens=30, stop=["def ", "\n\n"]), {}),
        (dict(temperature=0.8, seed=7, top_k=20, min_p=0.05, max_tokens=20, repetition_penalty=1.3,
              presence_penalty=0.4, frequency_penalty=0.3), {}),
        (dict(temperature=0.0, max_tokens=6, min_tokens=6, logprobs=True, top_logprobs=3),
         {"logprobs": 3}),
    ]
    for fields, engine_overrides in cases:
        tokens, text, last, logprobs = asyncio.run(generate_with_logprobs(stack.address, chat, fields))
        engine_fields = {k: v for k, v in fields.items() if k not in ("logprobs", "top_logprobs")}
        engine_fields["stop"] = tuple(engine_fields.get("stop", ()))
        expected = llm.chat([chat], SamplingParams(**engine_fields, **engine_overrides))[0]
        assert tokens == expected.token_ids, fields
        assert text == expected.text and last.finish_reason == expected.finish_reason, fields
        if "stop" in fields and fields["stop"]:
            assert last.finish_reason == "stop" and not any(st in text for st in fields["stop"])
        if fields.get("logprobs"):
            assert [lp.token_id for lp in logprobs] == tokens
            assert [len(lp.top_logprobs) for lp in logprobs] == [3] * len(tokens)
            for got, want in zip(logprobs, expected.logprobs):
                assert abs(got.logprob - want.logprob) < 1e-4
                assert got.top_logprobs[0].logprob >= got.logprob - 1e-6  # greedy: the top one
            assert logprobs[0].text == llm.tokenizer.decode([tokens[0]], skip_special_tokens=False)


async def generate_with_logprobs(address, messages, fields):
    request = gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(**m) for m in messages], **fields)
    async with grpc.aio.insecure_channel(address) as channel:
        tokens, text, last, logprobs = [], [], None, []
        async for msg in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=300):
            tokens.extend(msg.token_ids)
            text.append(msg.text)
            logprobs.extend(msg.logprobs)
            last = msg
        return tokens, "".join(text), last, logprobs
