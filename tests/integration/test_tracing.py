"""One trace per request on a real stack: gateway, prefill worker and two decode workers export
spans over OTLP/gRPC (the standard ``OTEL_*`` variables, sampler always_on, 200 ms batches) to a
receiver this test runs (``otlp_receiver.py``, built on opentelemetry-proto's service).

Checked: for one streamed request, every span of every service in the client's trace, the
parent-child tree, attributes equal to the request's real token counts and the KV transfer's
blocks and bytes; a client ``traceparent`` (gRPC metadata, HTTP header) as the root's parent;
a migrated request (the decode engine crashed by a test fault tag) shows the migration event
and both decode workers' spans. Every wait is on the receiver's spans, with a deadline.
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import grpc
import httpx
import pytest

from services.api import gateway_pb2, gateway_pb2_grpc
from services.runtime.launcher import Stack, UpOptions
from tests.integration.conftest import WORKER_ARGS, free_port, wait_until
from tests.integration.otlp_receiver import OTLPReceiver, Span

pytestmark = pytest.mark.integration

BLOCK_SIZE = 16
# one block of K and V over every layer of the built-in model, float32:
# 2 (K, V) * 30 layers * 16 tokens * 3 KV heads * 64 dims * 4 bytes
KV_BLOCK_BYTES = 2 * 30 * BLOCK_SIZE * 3 * 64 * 4
SPAN_TIMEOUT_S = 90


class TracedStack:
    def __init__(self) -> None:
        self.receiver = OTLPReceiver()
        endpoint = self.receiver.start()
        self.http_port = free_port()
        self.stack = Stack(UpOptions(
            host="127.0.0.1", port=free_port(), num_prefill=1, num_decode=2, redis_url=None,
            worker_args=WORKER_ARGS,
            gateway_args=["--heartbeat-s", "0.5", "--http-port", str(self.http_port)],
            env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
                 "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_TRACES_SAMPLER": "always_on",
                 "OTEL_BSP_SCHEDULE_DELAY": "200", "TANDEM_TEST_FAULT_INJECTION": "1"},
            ready_timeout_s=240))

    def stop(self) -> None:
        try:
            self.stack.stop()
        finally:
            self.receiver.stop()

    async def trace(self, trace_id: str, names: set[str], min_count: dict | None = None) -> list[Span]:
        """The spans of ``trace_id`` once the gateway's root span and each of ``names`` arrived
        (``min_count``: at least so many spans of a name). Each process exports on its own, so
        the root may come after the workers' spans."""
        need = {name: 1 for name in names} | (min_count or {})

        async def arrived():
            spans = [s for s in self.receiver.spans() if s.trace_id == trace_id]
            got = {n: sum(s.name == n for s in spans) for n in need}
            has_root = any(s.attributes.get("gen_ai.operation.name") for s in spans)
            return spans if has_root and all(got[n] >= k for n, k in need.items()) else None
        return await wait_until(arrived, SPAN_TIMEOUT_S, f"spans {need} of trace {trace_id}", poll_s=0.2)


@pytest.fixture(scope="module")
def ts() -> Iterator[TracedStack]:
    s = TracedStack()
    try:
        s.stack.start()
        s.stack.wait_ready()
        yield s
    finally:
        s.stop()


def chat(request_id: str, max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        request_id=request_id, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
        messages=[gateway_pb2.ChatMessage(role="user", content="Name three rivers in Europe.")])


async def generate(address: str, request, metadata=()) -> tuple[list[int], gateway_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        tokens, last = [], None
        async for msg in gateway_pb2_grpc.GatewayStub(channel).Generate(
                request, metadata=metadata, timeout=180):
            tokens.extend(msg.token_ids)
            last = msg
        return tokens, last


def one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.name, s.service) for s in spans])
    return found[0]


def root_of(spans: list[Span]) -> Span:
    [root] = [s for s in spans if s.attributes.get("gen_ai.operation.name")]
    return root


def test_one_streamed_request_is_one_trace_across_every_service(ts):
    client_trace, client_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    metadata = (("traceparent", f"00-{client_trace}-{client_span}-01"),)
    tokens, last = asyncio.run(generate(ts.stack.address, chat("traced-1", 9), metadata))
    assert len(tokens) == 9 and last.finish_reason == "length"
    prompt_tokens = last.usage.prompt_tokens

    spans = asyncio.run(ts.trace(client_trace, {"kv_reservation", "prefill", "kv_transfer",
                                                "decode", "kv_wait"}))
    root = root_of(spans)
    assert root.parent_id == client_span and root.kind == "SERVER"
    assert root.service == "tandem-gateway" and root.name.startswith("chat ")
    reservation, prefill, transfer = one(spans, "kv_reservation"), one(spans, "prefill"), one(spans, "kv_transfer")
    decode, wait = one(spans, "decode"), one(spans, "kv_wait")
    for child in (reservation, prefill, decode):
        assert child.parent_id == root.span_id, child.name
    assert transfer.parent_id == prefill.span_id and wait.parent_id == decode.span_id
    assert (prefill.service, decode.service) == ("tandem-prefill", "tandem-decode")
    assert transfer.service == "tandem-prefill" and wait.service == "tandem-decode"
    # the handoff window: the decode worker waited for the KV while the prefill worker wrote it
    assert wait.start_ns <= transfer.end_ns and transfer.start_ns <= wait.end_ns

    a = root.attributes
    assert a["gen_ai.response.id"] == "traced-1" and a["gen_ai.request.max_tokens"] == 9
    assert a["gen_ai.usage.input_tokens"] == prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == len(tokens) == last.usage.completion_tokens
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.usage.cache_read.input_tokens"] == prefill.attributes["gen_ai.usage.cache_read.input_tokens"]
    assert 0 < a["gen_ai.latency.time_to_first_token"] < a["gen_ai.latency.e2e"]
    assert prefill.attributes["gen_ai.usage.input_tokens"] == prompt_tokens
    assert decode.attributes["gen_ai.usage.output_tokens"] == len(tokens)
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert decode.attributes["tandem.num_preemptions"] == 0
    blocks = math.ceil(prompt_tokens / BLOCK_SIZE)
    t = transfer.attributes
    assert (t["tandem.kv_transfer.backend"], t["tandem.kv_transfer.outcome"]) == ("tcp", "landed")
    assert t["tandem.kv_transfer.blocks"] == blocks and t["tandem.kv_transfer.bytes"] == blocks * KV_BLOCK_BYTES
    assert reservation.attributes["tandem.kv_reservation.blocks"] == blocks
    assert wait.attributes["tandem.kv_wait.outcome"] == "landed"
    # the routing decision: workers, why, what they held, the cost (issue 26)
    assert a["tandem.decode_worker"] in ("decode-0", "decode-1")  # a tie: either may win
    assert a["tandem.prefill_worker"] == "prefill-0"
    assert a["tandem.routing.reason"] in ("kv_overlap", "load") and a["tandem.routing.cost"] >= 0
    assert a["tandem.routing.local_prefill"] is False
    assert a["tandem.kv_reservation.cached_blocks"] == 0  # nothing of it on the decode worker yet
    assert reservation.attributes["tandem.routing.reason"] == a["tandem.routing.reason"]
    assert not any(s.error for s in spans)


def test_a_client_traceparent_over_http_becomes_the_root_parent(ts):
    client_trace, client_span = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
    response = httpx.post(f"http://127.0.0.1:{ts.http_port}/v1/completions", timeout=180, json={
        "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0},
        headers={"traceparent": f"00-{client_trace}-{client_span}-01", "x-request-id": "traced-http"})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    spans = asyncio.run(ts.trace(client_trace, {"prefill", "decode", "kv_transfer"}))
    root = root_of(spans)
    assert root.parent_id == client_span and root.name.startswith("text_completion ")
    assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 3
    assert root.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]


def test_a_migrated_request_shows_the_migration_and_both_decode_workers(ts):
    # the first decode worker's engine dies once the request has 4 output tokens; the migrated
    # rest (max_tokens reduced below 4) finishes on the other one
    rid = "traced-migrate+crash_engine=4"
    tokens, last = asyncio.run(generate(ts.stack.address, chat(rid, 6)))
    assert len(tokens) == 6 and last.finish_reason == "length"

    async def root_arrived():
        return [s for s in ts.receiver.spans() if s.attributes.get("gen_ai.response.id") == rid]
    [root] = asyncio.run(wait_until(root_arrived, SPAN_TIMEOUT_S, "the migrated request's span"))
    spans = asyncio.run(ts.trace(root.trace_id, {"decode"}, {"decode": 2, "prefill": 2}))
    assert root.parent_id == ""  # no client context: a new trace
    events = [name for name, _ in root.events]
    assert "migration" in events, events
    migration = dict(root.events)["migration"]
    assert "decode worker" in migration["reason"] and migration["tandem.num_generated_tokens"] > 0
    decodes = [s for s in spans if s.name == "decode"]
    assert len({s.instance for s in decodes}) == 2, [s.instance for s in decodes]
    assert all(s.parent_id == root.span_id for s in decodes)
    failed = [s for s in decodes if s.error]
    assert len(failed) == 1 and failed[0].attributes["error.type"] == "Unavailable"
    assert root.attributes["gen_ai.usage.output_tokens"] == 6 and not root.error
    assert len([s for s in spans if s.name == "kv_reservation"]) == 2


def test_a_kv_transfer_that_failed_shows_the_recompute_on_the_request_span(ts):
    # the prefill worker's KV write fails; the decode worker computes the prompt itself (policy
    # recompute) and says so on its first token message: both are events on the request span
    rid = "traced-recompute+fail_kv_write"
    tokens, last = asyncio.run(generate(ts.stack.address, chat(rid, 5)))
    assert len(tokens) == 5 and last.finish_reason == "length"

    async def root_arrived():
        return [s for s in ts.receiver.spans() if s.attributes.get("gen_ai.response.id") == rid]
    [root] = asyncio.run(wait_until(root_arrived, SPAN_TIMEOUT_S, "the recomputed request's span"))
    events = dict(root.events)
    assert "kv_transfer_failed" in events and "recompute" in events, list(events)
    assert "was not written" in events["recompute"]["reason"]
    assert "migration" not in events and not root.error
