"""Issue 10's front-door findings on a real stack (gateway + prefill + decode on the real model):
each hostile input gets INVALID_ARGUMENT naming its field and the stack keeps serving exact
greedy output after it; a temperature below 1e-5 is greedy, not token 0 repeated; the
prefill worker's timings reach the request's record."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.api import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.integration

PROMPT = "What is the capital of France?"
GENERATE = "/tandem.v1.Gateway/Generate"


def chat(**options) -> gateway_pb2.GenerateRequest:
    fields = {"messages": [gateway_pb2.ChatMessage(role="user", content=PROMPT)], "max_tokens": 8,
              "temperature": 0.0, "ignore_eos": True, **options}
    return gateway_pb2.GenerateRequest(**fields)


async def generate(address: str, request: gateway_pb2.GenerateRequest) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        tokens = []
        async for msg in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=300):
            tokens.extend(msg.token_ids)
        return tokens


async def raw_error(address: str, body: bytes) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.unary_stream(GENERATE, request_serializer=None,
                               response_deserializer=gateway_pb2.GenerateResponse.FromString)(body, timeout=300)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
    return err.value


@pytest.fixture(scope="module")
def greedy(stack) -> list[int]:
    return asyncio.run(generate(stack.address, chat()))


def _utf8_body() -> bytes:
    return chat(messages=[gateway_pb2.ChatMessage(role="user", content="QQ")]).SerializeToString().replace(
        b"QQ", b"\xc3(")


HOSTILE = [
    ("invalid UTF-8", _utf8_body, "messages[0].content"),
    ("20 MB body", lambda: gateway_pb2.GenerateRequest(prompt="x" * 20_000_000).SerializeToString(), "request"),
    ("temperature inf", lambda: chat(temperature=float("inf")).SerializeToString(), "temperature"),
    ("top_logprobs 1000", lambda: chat(logprobs=True, top_logprobs=1000).SerializeToString(), "top_logprobs"),
    ("poison stop token", lambda: chat(min_tokens=1, stop_token_ids=[50000]).SerializeToString(),
     "stop_token_ids[0]"),
]


@pytest.mark.parametrize("case,body,field", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_input_is_refused_naming_the_field_and_the_stack_keeps_serving(stack, greedy, case, body, field):
    err = asyncio.run(raw_error(stack.address, body()))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details().startswith(f"{field}:"), err.details()
    assert "DecodeError" not in err.details()
    assert asyncio.run(generate(stack.address, chat())) == greedy


def test_temperature_below_epsilon_is_greedy(stack, greedy):
    tokens = asyncio.run(generate(stack.address, chat(temperature=1e-45)))
    assert tokens == greedy
    assert set(tokens) != {0}


def test_prefill_timings_are_recorded(stack):
    async def run():
        await generate(stack.address, chat(request_id="timed"))
        async with grpc.aio.insecure_channel(stack.address) as ch:
            return await gateway_pb2_grpc.GatewayStub(ch).GetRequest(
                gateway_pb2.GetRequestRequest(request_id="timed"))

    info = asyncio.run(run())
    assert info.status == "FINISHED"
    assert info.prefill_compute_time > 0 and info.kv_transfer_time > 0
    assert info.prefill_queue_time >= 0
