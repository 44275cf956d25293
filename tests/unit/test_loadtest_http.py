"""bench serve's OpenAI client against a small fake OpenAI SSE server on 127.0.0.1: exact framing
(``data: {...}``, blank line, ``data: [DONE]``), usage chunk, error events and HTTP errors."""
from __future__ import annotations

import asyncio
import json
import math

import pytest

from loadtest.arrivals import ArrivalSchedule
from loadtest.clients import OpenAIClient, _stream_error, parse_target
from loadtest.datasets import SampleRequest
from loadtest.metrics import RequestRecord, max_concurrency_seen
from loadtest.runner import RunConfig, run_benchmark

WORDS = ["Hello", " there", ",", " friend", "!"]


class FakeOpenAI:
    """Answers GET /v1/models and streaming POST /v1/{chat/,}completions; records each body."""

    def __init__(self, usage: bool = True, error_after: int | None = None, status: int = 200,
                 garbage: bool = False, models_status: int = 200, slow_s: float = 0.0):
        self.usage, self.error_after, self.status = usage, error_after, status
        self.garbage, self.models_status, self.slow_s = garbage, models_status, slow_s
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        method, path, _ = head.split("\r\n")[0].split(" ")
        headers = {k.lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in head.split("\r\n")[1:] if line)}
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        if method == "GET":
            self._reply(writer, self.models_status, "application/json",
                        json.dumps({"data": [{"id": "fake-model"}]}))
        elif self.status != 200:
            self._reply(writer, self.status, "application/json",
                        json.dumps({"error": {"message": "max_tokens: too big", "type": "BadRequest"}}))
        else:
            self.bodies.append(json.loads(body))
            self.headers.append(headers)
            await asyncio.sleep(self.slow_s)  # a slow server: holds a concurrency slot
            self._reply(writer, 200, "text/event-stream", "".join(self._events(path)))
        await writer.drain()
        writer.close()

    @staticmethod
    def _reply(writer, status: int, ctype: str, text: str) -> None:
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: "
                     f"{len(text.encode())}\r\nConnection: close\r\n\r\n{text}".encode())

    def _events(self, path: str):
        chat = path.endswith("/chat/completions")
        yield ": keep-alive comment\n\n"
        for i, word in enumerate(WORDS):
            if self.garbage and i == 1:
                yield "data: {not json\n\n"
            if self.error_after is not None and i == self.error_after:
                yield 'data: {"error": {"message": "engine died", "code": 500}}\n\n'
                break
            choice = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
            choice["finish_reason"] = "length" if i == len(WORDS) - 1 else None
            yield f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"
        if self.usage:
            usage = {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"


REQ = SampleRequest("raw prompt", 3, 5, True, "chat", ({"role": "user", "content": "hi"},))


async def _send(server: FakeOpenAI, endpoint: str = "chat", api_key: str = "") -> RequestRecord:
    client = OpenAIClient(await server.start(), endpoint=endpoint, api_key=api_key)
    record = RequestRecord(0, "chat", "req-1")
    clock = asyncio.get_running_loop().time
    try:
        assert await client.resolve_model() == "fake-model"
        await client.send(REQ, record, clock)
    finally:
        await client.close()
        server.server.close()
    return record


async def test_chat_stream_gives_tokens_usage_and_the_request_vllm_expects():
    server = FakeOpenAI()
    record = await _send(server, api_key="sekret")
    assert record.success and record.error == ""
    assert record.output_tokens == 7 and record.prompt_len == 12  # the server's usage wins
    assert len(record.itl) == len(WORDS) - 1 and all(x >= 0 for x in record.itl)
    assert record.sent_s <= record.first_token_s <= record.finish_s
    assert record.finish_reason == "length"
    body = server.bodies[0]
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["model"] == "fake-model"
    assert server.headers[0]["authorization"] == "Bearer sekret"
    assert server.headers[0]["x-request-id"] == "req-1"


async def test_completions_stream_without_usage_counts_chunks():
    server = FakeOpenAI(usage=False)
    record = await _send(server, endpoint="completions")
    assert server.bodies[0]["prompt"] == "raw prompt" and "messages" not in server.bodies[0]
    assert record.success and record.output_tokens == len(WORDS) and record.prompt_len == 3


async def test_an_error_event_fails_the_request_with_its_message():
    record = await _send(FakeOpenAI(error_after=2))
    assert not record.success and record.error == "engine died"


async def test_an_http_error_fails_the_request_with_status_and_body():
    record = await _send(FakeOpenAI(status=400))
    assert not record.success
    assert record.error.startswith("HTTP 400") and "max_tokens: too big" in record.error


async def test_a_whole_run_over_http_excludes_the_warm_up_and_records_every_request():
    server = FakeOpenAI()
    base = await server.start()
    cfg = RunConfig(base.replace("/v1", "/v1/"), ArrivalSchedule(math.inf), max_concurrency=2,
                    num_warmups=2, progress=False)
    outcome = await run_benchmark(cfg, [REQ] * 5)
    server.server.close()
    assert len(server.bodies) == 7  # 2 warm-ups + 5 counted
    assert len(outcome.records) == 5 and all(r.success for r in outcome.records)
    assert [r.request_id.rsplit("-", 1)[1] for r in outcome.records] == ["0", "1", "2", "3", "4"]
    assert outcome.model == "fake-model" and outcome.not_sent == 0 and outcome.duration_s > 0
    assert max_concurrency_seen(outcome.records) <= 2  # the cap held: all 5 were due at once


def test_a_run_shared_out_among_client_processes_sends_each_request_once():
    """``client_processes`` 3: every request sent once (one body each, besides each process's
    warm-up), records merged in dataset order with their scheduled times, the cap split
    (2 + 2 + 1 of 5), and the first process's resolved model."""
    import threading

    from loadtest.runner import run_load

    loop = asyncio.new_event_loop()
    server = FakeOpenAI(slow_s=0.2)
    base = loop.run_until_complete(server.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        requests = [SampleRequest(f"p{i}", 2, 4, True, "chat",
                                  ({"role": "user", "content": f"p{i}"},)) for i in range(11)]
        cfg = RunConfig(base, ArrivalSchedule(math.inf), max_concurrency=5, num_warmups=1,
                        progress=False, client_processes=3)
        outcome = run_load(cfg, requests)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert [r.index for r in outcome.records] == list(range(11))
    assert all(r.success and r.output_tokens for r in outcome.records)
    sent = sorted(b["prompt"] if "prompt" in b else b["messages"][0]["content"]
                  for b in server.bodies)
    assert len(sent) == 11 + 3  # each process warms up once
    assert sorted(set(sent)) == sorted(f"p{i}" for i in range(11))
    assert outcome.model == "fake-model" and outcome.not_sent == 0
    assert max_concurrency_seen(outcome.records) <= 5


def test_client_processes_need_a_share_of_the_cap_each():
    with pytest.raises(ValueError, match="client_processes"):
        RunConfig("http://127.0.0.1:1/v1", ArrivalSchedule(math.inf), max_concurrency=2,
                  client_processes=3)
    with pytest.raises(ValueError, match="client_processes"):
        RunConfig("http://127.0.0.1:1/v1", ArrivalSchedule(math.inf), client_processes=0)


async def test_nothing_is_sent_after_the_time_limit():
    server = FakeOpenAI()
    base = await server.start()
    schedule = ArrivalSchedule(20.0, seed=1)
    cfg = RunConfig(base, schedule, num_warmups=0, time_limit_s=0.1, progress=False)
    outcome = await run_benchmark(cfg, [REQ] * 50)
    server.server.close()
    due_later = int((schedule.times(50) > 0.1).sum())  # about 48 of 50 at 20 req/s
    assert due_later > 40
    assert outcome.not_sent >= due_later and len(outcome.records) + outcome.not_sent == 50
    assert len(server.bodies) == len(outcome.records)


async def test_requests_the_concurrency_cap_holds_past_the_time_limit_are_not_sent():
    server = FakeOpenAI(slow_s=1.5)  # longer than the limit: the first holds the cap past it
    base = await server.start()
    cfg = RunConfig(base, ArrivalSchedule(math.inf), max_concurrency=1, num_warmups=0,
                    time_limit_s=1.0, progress=False)
    outcome = await run_benchmark(cfg, [REQ] * 5)
    server.server.close()
    # all 5 are due at 0 (before the limit); the first holds the cap past it, the rest never go
    assert len(outcome.records) == 1 and outcome.not_sent == 4 and len(server.bodies) == 1


async def test_an_event_that_is_not_json_fails_the_request_naming_it():
    record = await _send(FakeOpenAI(garbage=True))
    assert not record.success and record.error.startswith("not JSON in an SSE event")


async def test_a_server_without_models_is_a_connection_error_naming_the_target():
    server = FakeOpenAI(models_status=404)
    base = await server.start()
    cfg = RunConfig(base, ArrivalSchedule(math.inf), progress=False)
    with pytest.raises(ConnectionError, match=f"^target {base}"):
        await run_benchmark(cfg, [REQ])
    server.server.close()
    assert server.bodies == []  # nothing was sent


@pytest.mark.parametrize("tokens, reason, error", [
    (3, "length", ""), (3, "stop", ""), (0, "stop", "stream ended without a token"),
    (3, "", "stream ended without a finish_reason"), (3, "abort", "aborted by the server"),
])
def test_grpc_stream_outcomes(tokens, reason, error):
    assert _stream_error(tokens, reason) == error


@pytest.mark.parametrize("target", ["127.0.0.1:50051", "ftp://x/v1", "grpc://", "http:///v1"])
def test_bad_targets_name_the_field(target):
    with pytest.raises(ValueError, match="^target"):
        parse_target(target)
