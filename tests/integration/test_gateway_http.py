"""The OpenAI-compatible HTTP front end on real workers: the module's stack (gateway, prefill,
decode, Redis) plus a second gateway run in-process with HTTP on, routing to the same workers.
Greedy output over HTTP equals the gRPC API's; SSE framing; errors as OpenAI's JSON; request
ids; a client gone mid-stream frees every block and Redis records ABORTED."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator

import grpc
import httpx
import pytest
import redis.asyncio as aioredis

from services.auth import internal_channel
from services.api import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.engine.model_files import default_model_path
from services.gateway.app import GatewayOptions
from services.state.registry import WorkerRegistry
from services.state.store import RequestStateStore
from tests.integration.conftest import GatewayThread, free_port

pytestmark = pytest.mark.integration

PROMPT = "What is the capital of France?"
DEADLINE_S = 60.0


class HttpGateway:
    def __init__(self, redis_url: str, internal_secret: str) -> None:
        self.redis_url, self.internal_secret = redis_url, internal_secret
        self.http_port = free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self._gateway = GatewayThread(GatewayOptions(
            "127.0.0.1", 0, self.redis_url, str(default_model_path()), rpc_timeout_s=120.0,
            heartbeat_s=0.5, http_port=self.http_port, internal_secret=self.internal_secret))

    def wait_ready(self) -> None:
        self._gateway.wait_http_ready(self.url)

    def close(self) -> None:
        self._gateway.close()


@pytest.fixture(scope="module")
def http(stack) -> Iterator[HttpGateway]:
    g = HttpGateway(stack.redis_url, stack.internal_secret)
    try:
        g.wait_ready()
        yield g
    finally:
        g.close()


def chat_body(**options) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True, **options}


def grpc_greedy(address: str, **options) -> str:
    async def run():
        request = gateway_pb2.GenerateRequest(
            messages=[gateway_pb2.ChatMessage(role="user", content=PROMPT)], max_tokens=8,
            temperature=0.0, ignore_eos=True, **options)
        async with grpc.aio.insecure_channel(address) as ch:
            return "".join([m.text async for m in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=300)])
    return asyncio.run(run())


def sse_events(response: httpx.Response) -> list[str]:
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line[len("data: "):] for line in lines]


def test_health_ready_and_models(http):
    assert http._gateway.ready_calls == 1  # on_ready: once, with every listener up
    assert httpx.get(f"{http.url}/health").status_code == 200
    assert httpx.get(f"{http.url}/ready").json()["ready"] is True
    models = httpx.get(f"{http.url}/v1/models").json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert models["data"][0]["max_model_len"] == 8192


def test_chat_completion_equals_grpc(http, stack):
    expected = grpc_greedy(stack.address)
    rid = f"http-whole-{uuid.uuid4().hex[:8]}"
    r = httpx.post(f"{http.url}/v1/chat/completions", json=chat_body(), headers={"X-Request-Id": rid},
                   timeout=300)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == expected
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8


def test_streaming_sse_framing_and_usage(http, stack):
    expected = grpc_greedy(stack.address)
    with httpx.stream("POST", f"{http.url}/v1/chat/completions", timeout=300,
                      json=chat_body(stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8
    assert all("usage" not in c for c in chunks[:-1])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == expected
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_completions_endpoint(http):
    r = httpx.post(f"{http.url}/v1/completions", timeout=300,
                   json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion" and r.json()["usage"]["completion_tokens"] <= 4


@pytest.mark.parametrize("body,status,param,code", [
    (chat_body(temperature=-1), 400, "temperature", None),
    (chat_body(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", None),
    (chat_body(stop_token_ids=[50000]), 400, "stop_token_ids[0]", None),
    (chat_body(messages=[{"role": "user", "content": "hello " * 9000}]), 400, "messages", "context_length_exceeded"),
    (chat_body(model="gpt-9"), 400, "model", None),
    ({"messages": "nope"}, 400, "messages", None),
], ids=["temperature", "role", "stop token", "context", "model", "bad type"])
def test_bad_input_is_openai_error_json(http, body, status, param, code):
    r = httpx.post(f"{http.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["code"] == code and error["message"]


def test_oversized_body_is_413_without_reading_it(http):
    r = httpx.post(f"{http.url}/v1/chat/completions", timeout=300,
                   content=b"{" + b" " * (5 * 1024 * 1024) + b"}", headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert "max_request_bytes" in r.json()["error"]["message"]


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(http, stack):
    rid = f"http-gone-{uuid.uuid4().hex[:8]}"
    with httpx.stream("POST", f"{http.url}/v1/chat/completions", timeout=300,
                      json=chat_body(max_tokens=2000, stream=True), headers={"X-Request-Id": rid}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break  # one token arrived: leave

    async def settled():
        client = aioredis.Redis.from_url(stack.redis_url)
        deadline = time.monotonic() + DEADLINE_S
        try:
            while True:
                record = await RequestStateStore(client).get(rid)
                loads = []
                for role, cls in (("decode", worker_pb2_grpc.DecodeWorkerStub), ("prefill", worker_pb2_grpc.PrefillWorkerStub)):
                    for w in await WorkerRegistry(client).list(role):
                        async with internal_channel(w.endpoint, stack.internal_secret) as ch:
                            loads.append(await cls(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=10))
                freed = loads and all(l.free_kv_blocks == l.total_kv_blocks and l.num_running == 0 for l in loads)
                if record and str(record["status"]) == "aborted" and freed:
                    return record
                assert time.monotonic() < deadline, (record, loads)
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()

    record = asyncio.run(settled())
    assert record["finish_reason"] == "abort" and record["output_tokens"] < 2000
