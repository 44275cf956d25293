"""API keys and per-key limits on real workers: the module's stack (gateway, prefill, decode,
Redis) plus in-process gateways routing to the same workers, one with keys (a flag key and a
keys file) and a requests/s limit, one open with a one-stream cap. Without a key: HTTP 401 and
gRPC UNAUTHENTICATED; with one: served; the keys file is re-read; 429 with Retry-After; the
streams cap; only the key that created a request may Abort or read it."""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api import gateway_pb2, gateway_pb2_grpc
from services.engine.model_files import default_model_path
from services.gateway.access import Access
from services.gateway.app import GatewayOptions
from services.gateway.keys import ApiKeys, key_digest
from services.gateway.limits import KeyLimits
from tests.integration.conftest import GatewayThread, assert_all_blocks_freed, free_port

pytestmark = pytest.mark.integration

FLAG_KEY = "flag-key-" + uuid.uuid4().hex
FILE_KEYS = {name: f"{name}-{uuid.uuid4().hex}" for name in ("http", "rate", "owner", "other", "late")}
RATE = 0.1  # requests/s per key: a second request within 10 s is refused, however slow the machine
DEADLINE_S = 120.0


class Gateway:
    """An in-process gateway with HTTP on, routing to ``stack``'s workers."""

    def __init__(self, stack, access: Access) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.address, self.url = f"127.0.0.1:{self.port}", f"http://127.0.0.1:{self.http_port}"
        self._thread = GatewayThread(GatewayOptions(
            "127.0.0.1", self.port, stack.redis_url, str(default_model_path()), rpc_timeout_s=120.0,
            heartbeat_s=0.5, http_port=self.http_port, internal_secret=stack.internal_secret,
            access=access))
        self._thread.wait_http_ready(self.url)

    def close(self) -> None:
        self._thread.close()


def write_keys(path: Path, names) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{key_digest(FILE_KEYS[n])} {n}\n" for n in names))
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    write_keys(path, ["http", "rate", "owner", "other"])
    return path


@pytest.fixture(scope="module")
def secured(stack, keys_file) -> Iterator[Gateway]:
    g = Gateway(stack, Access(ApiKeys(FLAG_KEY, str(keys_file)), KeyLimits(requests_per_s=RATE)))
    try:
        yield g
    finally:
        g.close()


def bearer(name: str) -> dict:
    return {"Authorization": f"Bearer {FILE_KEYS[name]}"}


def chat(**options) -> dict:
    return {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 4, "temperature": 0, "ignore_eos": True, **options}


def grpc_generate(address: str, key: str | None, max_tokens: int = 4, request_id: str = ""):
    async def run():
        metadata = [("authorization", f"Bearer {key}")] if key else None
        request = gateway_pb2.GenerateRequest(prompt="Paris is", max_tokens=max_tokens,
                                              temperature=0.0, ignore_eos=True, request_id=request_id)
        async with grpc.aio.insecure_channel(address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            return [m async for m in stub.Generate(request, metadata=metadata, timeout=300)]
    return asyncio.run(run())


def test_without_a_key_401_and_unauthenticated_health_open(secured):
    r = httpx.post(f"{secured.url}/v1/chat/completions", json=chat(), timeout=60)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{secured.url}/v1/chat/completions", json=chat(),
                   headers={"Authorization": "Bearer wrong"}, timeout=60)
    assert r.status_code == 401
    assert httpx.get(f"{secured.url}/v1/models", timeout=60).status_code == 401
    for key in (None, "wrong"):
        with pytest.raises(grpc.RpcError) as info:
            grpc_generate(secured.address, key)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert httpx.get(f"{secured.url}/health", timeout=60).status_code == 200

    async def health():
        async with grpc.aio.insecure_channel(secured.address) as ch:
            return await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=60)
    assert asyncio.run(health()).status == health_pb2.HealthCheckResponse.SERVING


def test_with_a_key_served_on_both_protocols(secured):
    msgs = grpc_generate(secured.address, FLAG_KEY)
    assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == 4
    r = httpx.post(f"{secured.url}/v1/chat/completions", json=chat(), headers=bearer("http"), timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_keys_file_change_applies_without_restart(secured, keys_file):
    url = f"{secured.url}/v1/models"
    assert httpx.get(url, headers=bearer("late"), timeout=60).status_code == 401
    write_keys(keys_file, ["http", "rate", "owner", "other", "late"])
    assert httpx.get(url, headers=bearer("late"), timeout=60).status_code == 200
    write_keys(keys_file, ["http", "rate", "owner", "other"])
    assert httpx.get(url, headers=bearer("late"), timeout=60).status_code == 401


def test_rate_limited_key_gets_429_with_retry_after(secured):
    url = f"{secured.url}/v1/chat/completions"
    first = httpx.post(url, json=chat(max_tokens=-1), headers=bearer("rate"), timeout=60)
    assert first.status_code == 400  # counted, though refused as bad input
    second = httpx.post(url, json=chat(), headers=bearer("rate"), timeout=60)
    assert second.status_code == 429, second.text
    assert 1 <= int(second.headers["retry-after"]) <= 1 / RATE
    error = second.json()["error"]
    assert error["type"] == "rate_limit_error" and "rate_limit_requests_per_s" in error["message"]
    assert FILE_KEYS["rate"] not in second.text


def test_only_the_creating_key_may_abort_or_read(secured, stack):
    rid = f"owned-{uuid.uuid4().hex[:8]}"

    async def run():
        own = [("authorization", f"Bearer {FILE_KEYS['owner']}")]
        other = [("authorization", f"Bearer {FILE_KEYS['other']}")]
        request = gateway_pb2.GenerateRequest(prompt="Count: one two", max_tokens=2000,
                                              ignore_eos=True, request_id=rid)
        async with grpc.aio.insecure_channel(secured.address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            call = stub.Generate(request, metadata=own, timeout=300)
            first = await call.read()  # the request is in flight
            assert first.request_id == rid
            assert not (await stub.Abort(gateway_pb2.AbortRequest(request_id=rid), metadata=other)).found
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetRequest(gateway_pb2.GetRequestRequest(request_id=rid), metadata=other)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            mine = await stub.GetRequest(gateway_pb2.GetRequestRequest(request_id=rid), metadata=own)
            assert mine.status in ("QUEUED", "PREFILLING", "DECODING")
            assert (await stub.Abort(gateway_pb2.AbortRequest(request_id=rid), metadata=own)).found
            last = first
            while (msg := await call.read()) is not grpc.aio.EOF:
                last = msg
            assert last.finish_reason == "abort"
            return await stub.GetRequest(gateway_pb2.GetRequestRequest(request_id=rid), metadata=own)

    record = asyncio.run(run())
    assert record.status == "ABORTED"
    asyncio.run(assert_all_blocks_freed(stack, DEADLINE_S))


@pytest.fixture(scope="module")
def capped(stack) -> Iterator[Gateway]:
    g = Gateway(stack, Access(limits=KeyLimits(max_streams=1)))  # open: one anonymous key
    try:
        yield g
    finally:
        g.close()


def test_streams_cap_refuses_the_next_until_one_ends(capped, stack):
    url = f"{capped.url}/v1/completions"
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # NOTE: held: closing the iterator would close the stream
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # streaming: the one place is taken
        refused = httpx.post(url, json={**body, "stream": False, "max_tokens": 2}, timeout=60)
        assert refused.status_code == 429, refused.text
        assert "max_streams_per_key" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "1"
        with pytest.raises(grpc.RpcError) as info:
            grpc_generate(capped.address, None)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_streams_per_key" in info.value.details()
        assert ("retry-after", "1") in tuple(info.value.trailing_metadata())
        lines.close()
    # the client left: the stream is aborted and its place freed; then a request is accepted
    deadline = time.monotonic() + DEADLINE_S
    while True:
        r = httpx.post(url, json={**body, "stream": False, "max_tokens": 2}, timeout=300)
        if r.status_code == 200:
            break
        assert r.status_code == 429 and time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert r.json()["usage"]["completion_tokens"] == 2
    asyncio.run(assert_all_blocks_freed(stack, DEADLINE_S))
