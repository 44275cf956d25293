"""OpenAI HTTP on the wire, below any client library: the exact SSE framing of chat and
completions streams (n = 1 and n > 1), an error after the stream started (an injected engine
fault) as an error event then ``[DONE]``, and so a request aborted by id, a 10 MB body refused with 413 from its header alone,
and clients that go away (non-streaming; streaming with n > 1) abort every choice: all blocks
free on both workers (GetLoad) and Redis says ABORTED."""
from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis.asyncio as aioredis

from services.runtime.launcher import Stack, UpOptions
from services.state.store import RequestStateStore
from tests.integration.conftest import WORKER_ARGS, assert_all_blocks_freed, free_port, wait_until
from tests.reference import CHAT_PROMPTS

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
DEADLINE_S = 60.0


class HttpStack:
    def __init__(self, stack: Stack, http_port: int) -> None:
        self.stack = stack
        self.port = http_port
        self.url = f"http://127.0.0.1:{http_port}"


@pytest.fixture(scope="module")
def http_stack(redis_server) -> Iterator[HttpStack]:
    """A stack whose workers honour fault tags in request ids (only tagged requests fail)."""
    port = free_port()
    s = Stack(UpOptions(host="127.0.0.1", port=free_port(), num_prefill=1, num_decode=1,
                        redis_url=redis_server.url, worker_args=WORKER_ARGS,
                        gateway_args=["--heartbeat-s", "0.5", "--http-port", str(port)],
                        ready_timeout_s=180, env={"TANDEM_TEST_FAULT_INJECTION": "1"}))
    try:
        s.start()
        s.wait_ready()
        yield HttpStack(s, port)
    finally:
        s.stop()


def chat_body(**options) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": CHAT_PROMPTS[0]}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True, **options}


def raw_events(http_stack: HttpStack, path: str, body: dict, headers: dict | None = None) -> list[str]:
    """The payloads of the SSE events of one streamed request, checked to be framed exactly as
    ``data: <payload>\\n\\n`` with nothing else on the wire."""
    with httpx.stream("POST", f"{http_stack.url}{path}", json=body, headers=headers or {}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw()).decode()
    assert raw.endswith("\n\n"), raw[-200:]
    events = raw[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [e[len("data: "):] for e in events]


def test_chat_stream_framing(http_stack):
    events = raw_events(http_stack, "/v1/chat/completions", chat_body())
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert len({c["created"] for c in chunks}) == 1 and isinstance(chunks[0]["created"], int)
    assert {c["model"] for c in chunks} == {MODEL}
    assert all("usage" not in c and len(c["choices"]) == 1 for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert {c["choices"][0]["index"] for c in chunks} == {0}


def test_completions_stream_framing_with_usage(http_stack):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events = raw_events(http_stack, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    *content, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5
    assert "cached_tokens" in usage["usage"]["prompt_tokens_details"]
    assert all("usage" not in c and "text" in c["choices"][0] for c in content)
    assert content[-1]["choices"][0]["finish_reason"] == "length"


def test_n_choices_stream_framing(http_stack):
    events = raw_events(http_stack, "/v1/chat/completions",
                        chat_body(n=2, stream_options={"include_usage": True}))
    chunks = [json.loads(e) for e in events[:-1]]
    *content, usage = chunks
    assert len({c["id"] for c in chunks}) == 1
    assert all(len(c["choices"]) == 1 for c in content)
    by_index: dict[int, list[dict]] = {}
    for c in content:
        by_index.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
    assert sorted(by_index) == [0, 1]
    for choices in by_index.values():
        assert choices[0]["delta"]["role"] == "assistant" and choices[-1]["finish_reason"] == "length"
    texts = ["".join(c["delta"]["content"] for c in by_index[i]) for i in (0, 1)]
    assert texts[0] == texts[1]  # greedy: equal choices
    assert usage["usage"]["completion_tokens"] == 12


def test_error_after_the_stream_started_is_an_error_event_then_done(http_stack):
    rid = f"sse-fault-{uuid.uuid4().hex[:8]}+raise_in_step=3"
    events = raw_events(http_stack, "/v1/chat/completions", chat_body(max_tokens=20),
                        headers={"X-Request-Id": rid})
    assert events[-1] == "[DONE]"
    *content, error = [json.loads(e) for e in events[:-1]]
    assert content and all("choices" in c for c in content)  # tokens went out before the fault
    assert set(error) == {"error"} and error["error"]["message"] and error["error"]["type"]
    asyncio.run(assert_all_blocks_freed(http_stack.stack, timeout_s=DEADLINE_S))


def test_an_aborted_stream_ends_with_an_error_event_not_an_abort_finish_reason(http_stack):
    """OpenAI's finish reasons have no "abort": a request aborted by id (gRPC Abort) is an
    error event on its HTTP stream, then ``[DONE]``."""
    import grpc

    from services.api import gateway_pb2, gateway_pb2_grpc

    rid = f"sse-abort-{uuid.uuid4().hex[:8]}"

    async def scenario() -> list[str]:
        async with httpx.AsyncClient(timeout=300) as client, grpc.aio.insecure_channel(http_stack.stack.address) as ch:
            async with client.stream("POST", f"{http_stack.url}/v1/chat/completions", headers={"X-Request-Id": rid},
                                     json=chat_body(max_tokens=2000)) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                events = [await anext(lines)]  # the first chunk
                found = await gateway_pb2_grpc.GatewayStub(ch).Abort(gateway_pb2.AbortRequest(request_id=rid))
                assert found.found
                events += [line async for line in lines if line]
        return [e.removeprefix("data: ") for e in events]

    events = asyncio.run(scenario())
    assert events[-1] == "[DONE]"
    *content, error = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"][0]["finish_reason"] is None for c in content), content[-1]
    assert "aborted" in error["error"]["message"] and error["error"]["type"] == "server_error"
    asyncio.run(assert_all_blocks_freed(http_stack.stack, timeout_s=DEADLINE_S))


def test_ten_megabyte_body_is_413_from_its_header(http_stack):
    """Only the headers and 1 KiB of a declared 10 MB body are sent: the answer comes anyway."""
    with socket.create_connection(("127.0.0.1", http_stack.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10485760\r\n\r\n" + b" " * 1024)
        head = _read_response(sock)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    body = json.loads(head.split(b"\r\n\r\n", 1)[1])
    assert "max_request_bytes" in body["error"]["message"] and body["error"]["param"] == "request"
    r = httpx.post(f"{http_stack.url}/v1/chat/completions", json=chat_body(stream=False), timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def _read_response(sock: socket.socket) -> bytes:
    """One HTTP response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or _eof()
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536) or _eof()
    return head + b"\r\n\r\n" + body


def _eof() -> bytes:
    raise AssertionError("connection closed before the whole response")


async def _status(redis_url: str, rid: str) -> str | None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        record = await RequestStateStore(client).get(rid)
        return None if record is None else str(record["status"])
    finally:
        await client.aclose()


def test_non_streaming_client_gone_aborts_and_frees_blocks(http_stack):
    rid = f"http-gone-whole-{uuid.uuid4().hex[:8]}"
    body = json.dumps(chat_body(stream=False, max_tokens=2000)).encode()
    url = http_stack.stack.redis_url
    with socket.create_connection(("127.0.0.1", http_stack.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"X-Request-Id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)

        async def decoding():
            return await _status(url, rid) == "decoding"
        asyncio.run(wait_until(decoding, DEADLINE_S, f"{rid} decoding"))
    # the client is gone mid-generation

    async def aborted():
        return await _status(url, rid) == "aborted"
    asyncio.run(wait_until(aborted, DEADLINE_S, f"{rid} ABORTED in Redis"))
    asyncio.run(assert_all_blocks_freed(http_stack.stack, timeout_s=DEADLINE_S))


def test_streaming_client_gone_aborts_every_choice(http_stack):
    rid = f"http-gone-n-{uuid.uuid4().hex[:8]}"
    with httpx.stream("POST", f"{http_stack.url}/v1/chat/completions", timeout=300,
                      json=chat_body(n=3, max_tokens=2000, temperature=1.0, seed=7),
                      headers={"X-Request-Id": rid}) as r:
        seen: set[int] = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if len(seen) == 3:
                break  # every choice is decoding: leave

    async def all_aborted():
        return [await _status(http_stack.stack.redis_url, f"{rid}-{i}") for i in range(3)] == ["aborted"] * 3
    asyncio.run(wait_until(all_aborted, DEADLINE_S, "every choice ABORTED in Redis"))
    asyncio.run(assert_all_blocks_freed(http_stack.stack, timeout_s=DEADLINE_S))
    start = time.monotonic()
    r = httpx.post(f"{http_stack.url}/v1/completions", timeout=300,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, (r.text, time.monotonic() - start)
