"""Several gateway processes on one port (`tandem up --num-gateways N`, gateway.reuse_port,
vLLM's --api-server-count): the kernel spreads new connections over the processes (gRPC and
HTTP), each answers from the same prefill and decode workers (over its own Follow stream),
each reports its own /metrics and /ready on a port of its own (the Prometheus scrape config
lists each), and one that dies leaves the port served by the rest."""
from __future__ import annotations

import asyncio
import os
import signal
import urllib.request

import grpc
import httpx
import pytest

from services.api import gateway_pb2_grpc
from services.runtime.launcher import Stack
from tests.integration.conftest import http_stack_with, wait_until
from tests.integration.test_prometheus import gateway_samples
from tests.integration.test_stack import chat_request
from tests.reference import CHAT_PROMPTS, hf_greedy_outputs

pytestmark = pytest.mark.integration
CONNECTIONS = 24  # per protocol: all on one of 2 processes by chance has probability 2^-23
TOKENS = 4
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def gateways(redis_server):
    """Two gateways sharing the gRPC and HTTP ports before a prefill and a decode worker;
    (stack, HTTP port)."""
    with http_stack_with(redis_server.url, [], num_gateways=2) as s:
        yield s.stack, s.http_port


def gateway_names(stack: Stack) -> list[str]:
    return [n for n, _ in stack.procs if n.startswith("gateway")]


def scrape(address: str, path: str = "/metrics") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def requests_ok(address: str) -> float:
    """The gateway's ``tandem:requests_total{code="OK"}`` (gRPC and HTTP alike)."""
    return gateway_samples(f"http://{address}")[("tandem:requests_total", "OK")]


async def grpc_answer(address: str, prompt: str) -> tuple[list[int], str]:
    """(tokens, text) of one request over a channel of its own connection (a local subchannel
    pool: gRPC would otherwise share one connection between channels to the same address)."""
    async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        tokens, text = [], []
        async for msg in gateway_pb2_grpc.GatewayStub(ch).Generate(
                chat_request(prompt, max_tokens=TOKENS), timeout=300):
            tokens.extend(msg.token_ids)
            text.append(msg.text)
        return tokens, "".join(text)


def http_text(port: int, prompt: str) -> str:
    """One chat completion over a connection of its own (httpx without a client: a new one
    each)."""
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def test_connections_spread_over_the_gateways_and_each_answers_right(gateways):
    stack, http_port = gateways
    names = gateway_names(stack)
    assert len(names) == 2 and len({stack.metrics_targets[n] for n in names}) == 2
    before = {n: requests_ok(stack.metrics_targets[n]) for n in names}
    prompts = [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(CONNECTIONS)]
    expected = [list(hf_greedy_outputs()[i % len(CHAT_PROMPTS)][:TOKENS])
                for i in range(CONNECTIONS)]

    async def over_grpc():
        return await asyncio.gather(*(grpc_answer(stack.address, p) for p in prompts))

    answers = asyncio.run(over_grpc())
    assert [tokens for tokens, _ in answers] == expected
    mid = {n: requests_ok(stack.metrics_targets[n]) for n in names}
    assert all(mid[n] > before[n] for n in names), (before, mid)  # both took gRPC connections
    assert sum(mid.values()) - sum(before.values()) == CONNECTIONS
    assert [http_text(http_port, p) for p in prompts] == [text for _, text in answers]
    after = {n: requests_ok(stack.metrics_targets[n]) for n in names}
    assert all(after[n] > mid[n] for n in names), (mid, after)  # and HTTP ones
    assert sum(after.values()) - sum(mid.values()) == CONNECTIONS


def test_each_gateway_reports_its_own_metrics_and_readiness(gateways):
    stack, _ = gateways
    scrape_config = (stack.run_dir / "prometheus.yml").read_text()
    for name in gateway_names(stack):
        address = stack.metrics_targets[name]
        assert scrape(address, "/ready") == (200, '{"ready": true, "reason": ""}')
        assert address in scrape_config
        assert "tandem:requests_total" in scrape(address)[1]


def test_bench_serve_reaches_every_gateway_from_its_processes_and_channels(gateways):
    """The load generator that measures them: 2 client processes of 12 gRPC channels each
    (``--client-processes 2 --grpc-channels 12``) send every request once, all answered, and
    both gateways relay some."""
    import math

    from loadtest.arrivals import ArrivalSchedule
    from loadtest.datasets import SampleRequest
    from loadtest.runner import RunConfig, run_load

    stack, _ = gateways
    names = gateway_names(stack)
    before = {n: requests_ok(stack.metrics_targets[n]) for n in names}
    requests = [SampleRequest("", 8, TOKENS, True, "chat",
                              ({"role": "user", "content": CHAT_PROMPTS[i % 8]},))
                for i in range(CONNECTIONS)]
    outcome = run_load(RunConfig(f"grpc://{stack.address}", ArrivalSchedule(math.inf),
                                 max_concurrency=CONNECTIONS, num_warmups=0, progress=False,
                                 client_processes=2, grpc_channels=CONNECTIONS // 2), requests)
    assert [r.index for r in outcome.records] == list(range(CONNECTIONS))
    assert all(r.success and r.output_tokens == TOKENS for r in outcome.records)
    after = {n: requests_ok(stack.metrics_targets[n]) for n in names}
    assert all(after[n] > before[n] for n in names), (before, after)
    assert sum(after.values()) - sum(before.values()) == CONNECTIONS


def test_a_dead_gateway_leaves_the_port_to_the_others(gateways):
    """SIGKILL one gateway (its listening sockets close with it): new connections on both
    ports go to the one left, whatever their hash. Last in this module: the stack's
    supervisor is not running here, so the gateway stays dead."""
    stack, http_port = gateways
    first, second = gateway_names(stack)
    proc = stack.process(second)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    before = requests_ok(stack.metrics_targets[first])
    expected = list(hf_greedy_outputs()[0][:TOKENS])

    async def over_grpc():
        return await asyncio.gather(*(grpc_answer(stack.address, CHAT_PROMPTS[0])
                                      for _ in range(8)))

    answers = asyncio.run(over_grpc())
    assert [tokens for tokens, _ in answers] == [expected] * 8
    assert [http_text(http_port, CHAT_PROMPTS[0]) for _ in range(8)] == [answers[0][1]] * 8
    asyncio.run(wait_until(
        lambda: asyncio.sleep(0, requests_ok(stack.metrics_targets[first]) - before == 16),
        10, "the gateway left counted every request"))
