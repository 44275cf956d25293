"""Routing by what the pool holds (issue 26), with real processes and a real Redis.

- 4 unified workers, ``--routing kv``: the second request of each shared prefix lands on the
  worker that computed the first and reports the prefix as ``cached_tokens``; a second gateway
  on the same Redis, which routed none of them, sends it there too (it read the KV events);
  after that worker is killed its entries leave both gateways' indexes and requests go
  elsewhere; restarted under the same id it publishes an empty cache.
- 1 prefill + 1 decode worker: a prompt whose prefix the decode worker holds transfers only the
  blocks after it (bytes counted on the decode worker's side of the wire) and its greedy output
  equals transformers' in float32; a short prompt queued behind a long one is prefilled on the
  decode worker (``pd_threshold_tokens``) and done before the long one's first token; once the
  gateway has measured slow KV handoffs for the pair, a prompt over the threshold is prefilled
  on the idle decode worker.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import grpc
import pytest
import redis

from services.api import gateway_pb2, gateway_pb2_grpc
from services.engine.kv_events import prompt_block_hashes
from services.runtime.launcher import Stack, UpOptions
from services.state.kv_events import stream_key
from tests.integration.conftest import (WORKER_ARGS, assert_all_blocks_freed, free_port,
                                        registered_workers, running, wait_until)
from tests.integration.test_stack import chat_request, generate
from tests.reference import CHAT_PROMPTS, chat_prompt_ids, hf_greedy_outputs, tokenizer

pytestmark = pytest.mark.integration
BS = 16  # the stacks' block size (the default)


def metric(address: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` (with ``labels``) in a process's /metrics."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"([a-zA-Z_:]+)(\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "")
                                            for k, v in labels.items()):
            total += float(m.group(3))
    return total


async def info_of(address: str, request_id: str) -> gateway_pb2.RequestInfo:
    async with grpc.aio.insecure_channel(address) as ch:
        return await gateway_pb2_grpc.GatewayStub(ch).GetRequest(
            gateway_pb2.GetRequestRequest(request_id=request_id), timeout=10)


async def serve_prompt(address: str, prompt: str, request_id: str, max_tokens: int = 4):
    """(worker that computed it, cached tokens it reported)."""
    _, _, last = await generate(address, gateway_pb2.GenerateRequest(
        prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
        request_id=request_id))
    info = await info_of(address, request_id)
    return info.decode_worker, last.usage.cached_tokens


def document(seed: int, words: int = 160) -> str:
    """A long shared prefix (well over 10 blocks) that differs from every other seed's at once."""
    return f"Document {seed}. " + " ".join(f"w{(seed * 7919 + i * 104729) % 10007}"
                                           for i in range(words))


@pytest.fixture(scope="module")
def unified4(redis_server):
    s = Stack(UpOptions(host="127.0.0.1", port=free_port(), num_prefill=0, num_decode=0,
                        num_unified=4, redis_url=redis_server.url, worker_args=WORKER_ARGS,
                        gateway_args=["--heartbeat-s", "0.5", "--routing", "kv"],
                        ready_timeout_s=300))
    with running(s):
        s.add_gateway("gateway-2", second := free_port())
        s.second_address = f"127.0.0.1:{second}"
        asyncio.run(wait_until(lambda: _serving(s.second_address), 120, "second gateway ready"))
        yield s


async def _serving(address: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        async with grpc.aio.insecure_channel(address) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.aio.AioRpcError:
        return False


def test_kv_routing_sends_each_shared_prefix_back_where_it_was_computed(unified4):
    first_gateway, second_gateway = unified4.address, unified4.second_address
    second_metrics = unified4.metrics_targets["gateway-2"]

    async def run():
        homes = {}
        for d in range(3):
            doc = document(d)
            worker, cached = await serve_prompt(first_gateway, doc + " Q: first?", f"doc{d}-q0")
            assert cached == 0
            homes[d] = worker
            worker, cached = await serve_prompt(first_gateway, doc + " Q: second?", f"doc{d}-q1")
            assert worker == homes[d], f"document {d}'s second question went elsewhere"
            shared = len(tokenizer().encode(doc + " Q:")) // BS * BS
            assert cached >= shared - BS, (cached, shared)
        # the second gateway routed nothing yet: only the workers' KV events tell it. Wait
        # until each home's stream holds its document's blocks (publishers flush every
        # FLUSH_S) and the second gateway's index holds every hash published so far (each
        # stream read once is not enough: it may have been read before the last entries)
        await wait_until(lambda: _async(metric(second_metrics, "tandem:kv_index_workers",
                                               mode="events") == 4), 60, "events from 4 workers")
        client = redis.Redis.from_url(unified4.redis_url)
        for d, home in homes.items():
            first_blocks = prompt_block_hashes(tokenizer().encode(document(d) + " Q:"), BS)[:2]
            await wait_until(lambda: _async(all(h in stored_hashes(client, home)
                                                for h in first_blocks)), 30,
                             f"document {d}'s blocks in {home}'s KV events")
        published = sum(len(stored_hashes(client, f"unified-{i}")) for i in range(4))
        await wait_until(lambda: _async(metric(second_metrics, "tandem:kv_index_blocks")
                                        >= published), 30,
                         f"the second gateway's index holding all {published} published blocks")
        for d in range(3):
            worker, cached = await serve_prompt(second_gateway, document(d) + " Q: third?",
                                                f"doc{d}-q2")
            assert worker == homes[d] and cached > 0
        assert metric(second_metrics, "tandem:routing_decisions_total", reason="kv_overlap") >= 3
        assert metric(second_metrics, "tandem:kv_index_blocks") > 0
        return homes

    homes = asyncio.run(run())
    unified4.homes = homes


def stored_hashes(client: redis.Redis, worker_id: str) -> set[int]:
    """The block hashes ``worker_id``'s KV event stream says its cache holds now."""
    held: set[int] = set()
    for _, fields in client.xrange(stream_key(worker_id)):
        for kind, *hashes in json.loads(fields[b"events"]):
            if kind == "cleared":
                held.clear()
            elif kind == "stored":
                held.update(hashes[0])
            else:
                held.difference_update(hashes[0])
    return held


def test_gateway_hashes_match_what_workers_publish(unified4):
    """The gateway's hashes of a prompt are the worker's stored hashes (one interpreter)."""
    ids = tokenizer().encode(document(1) + " Q: first?")
    client = redis.Redis.from_url(unified4.redis_url)
    home = unified4.homes[1] if getattr(unified4, "homes", None) else None
    if home is None:
        pytest.skip("needs the routing test before it")
    published = b"".join(fields[b"events"] for _, fields in client.xrange(stream_key(home)))
    for h in prompt_block_hashes(ids, BS)[:4]:
        assert str(h).encode() in published


def test_a_killed_worker_leaves_the_index_and_a_restarted_one_starts_empty(unified4):
    homes = getattr(unified4, "homes", None)
    if homes is None:
        pytest.skip("needs the routing test before it")
    victim = homes[0]
    metrics, second = unified4.metrics_targets["gateway"], unified4.metrics_targets["gateway-2"]
    unified4.process(victim).kill()

    async def run():
        t0 = time.monotonic()
        # the first gateway finds it dead on this request: the retry goes elsewhere, and the
        # victim's entries go at once
        worker, cached = await serve_prompt(unified4.address, document(0) + " Q: after?",
                                            "doc0-after-kill")
        assert worker != victim and cached == 0  # nobody else held document 0
        assert metric(metrics, "tandem:kv_index_workers") == 3
        # the second gateway sent it nothing: its registry entry's expiry tells it
        await wait_until(lambda: _async(metric(second, "tandem:kv_index_workers") == 3), 30,
                         "the killed worker's entries dropped from the second gateway's index")
        dropped_s = time.monotonic() - t0
        unified4.add_worker("unified", victim)  # the supervisor's restart: same id
        await wait_until(lambda: _async(metric(metrics, "tandem:kv_index_workers",
                                               mode="events") == 4), 240, "restarted worker read")
        entries = redis.Redis.from_url(unified4.redis_url).xrange(stream_key(victim))
        assert len(entries) == 1  # its new epoch's snapshot alone: the old one trimmed
        assert entries[0][1][b"events"] == b'[["cleared"],["stored",[]]]'
        again, cached = await serve_prompt(unified4.address, document(0) + " Q: again?",
                                           "doc0-after-restart")
        assert again == worker and cached > 0  # where document 0 lives now
        return dropped_s

    dropped_s = asyncio.run(run())
    print(f"the second gateway's index dropped the killed worker {dropped_s:.2f}s after the "
          "kill (registry TTL: 3 heartbeats of 0.5 s)")
    asyncio.run(assert_all_blocks_freed(unified4, timeout_s=30))


async def _async(value):
    return value


@pytest.fixture(scope="module")
def pd_stack():
    s = Stack(UpOptions(host="127.0.0.1", port=free_port(), num_prefill=1, num_decode=1,
                        redis_url=None,  # its own: the unified stack above may still run
                        worker_args=["--num-threads", "1", "--kv-cache-gib", "1", "--heartbeat-s",
                                     "0.5"],
                        gateway_args=["--heartbeat-s", "0.5", "--routing", "kv",
                                      "--pd-threshold-tokens", "0"], ready_timeout_s=300))
    with running(s):
        yield s


def test_decode_side_reuse_transfers_only_the_uncached_blocks_and_matches_the_oracle(pd_stack):
    decode = pd_stack.metrics_targets["decode-0"]
    reference = hf_greedy_outputs()
    first, second = chat_prompt_ids(CHAT_PROMPTS[0]), chat_prompt_ids(CHAT_PROMPTS[1])
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    cached_blocks = min(common // BS, (len(second) - 1) // BS)
    assert cached_blocks >= 1  # the chat template's system prompt

    def blocks(n: int) -> int:
        return -(-n // BS)

    async def run():
        before = metric(decode, "tandem:kv_received_bytes_total")
        tokens, _, _ = await generate(pd_stack.address, chat_request(CHAT_PROMPTS[0]))
        assert tokens == list(reference[0])
        one = metric(decode, "tandem:kv_received_bytes_total") - before
        bytes_per_block = one / blocks(len(first))
        assert bytes_per_block == 30 * 2 * BS * 3 * 64 * 4  # layers x K,V x tokens x heads x dim x fp32
        tokens, _, _ = await generate(pd_stack.address, chat_request(CHAT_PROMPTS[1],
                                                                     request_id="reuse"))
        assert tokens == list(reference[1])  # pinned prefix + written tail: the oracle's tokens
        two = metric(decode, "tandem:kv_received_bytes_total") - before - one
        assert two == (blocks(len(second)) - cached_blocks) * bytes_per_block
        info = await info_of(pd_stack.address, "reuse")
        assert info.prefill_worker == "prefill-0" and info.decode_worker == "decode-0"

    asyncio.run(run())
    asyncio.run(assert_all_blocks_freed(pd_stack, timeout_s=30))


def test_a_short_prompt_behind_a_long_one_is_prefilled_on_the_decode_worker():
    """With the threshold policy the short prompt never waits in the prefill queue: it is done
    (first token and all) before the 8k-token prompt's first token. TTFT against an idle stack
    is measured by ``scripts/bench_pd_threshold.py`` (timings are not asserted in tests)."""
    s = Stack(UpOptions(host="127.0.0.1", port=free_port(), num_prefill=1, num_decode=1,
                        redis_url=None,
                        worker_args=["--num-threads", "1", "--kv-cache-gib", "1", "--heartbeat-s",
                                     "0.5", "--dtype", "auto", "--quantization", "auto"],
                        gateway_args=["--heartbeat-s", "0.5", "--pd-threshold-tokens", "256"],
                        ready_timeout_s=300))
    long_prompt = tokenizer().decode(tokenizer().encode(
        " ".join(f"w{i % 997}" for i in range(2500)))[:8000])  # about 8k tokens

    async def run():
        ended: dict[str, float] = {}

        async def timed(name, request):
            async with grpc.aio.insecure_channel(s.address) as ch:
                async for msg in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=600):
                    if msg.token_ids and f"{name}-first" not in ended:
                        ended[f"{name}-first"] = time.monotonic()
                ended[name] = time.monotonic()

        long = asyncio.ensure_future(timed("long", gateway_pb2.GenerateRequest(
            prompt=long_prompt, max_tokens=2, temperature=0.0, ignore_eos=True,
            request_id="long")))
        await asyncio.sleep(1.0)  # the long prompt is in the prefill worker's hands
        await timed("short", chat_request(CHAT_PROMPTS[2], max_tokens=4, request_id="short"))
        await long
        assert ended["short"] < ended["long-first"]
        short, long_info = await info_of(s.address, "short"), await info_of(s.address, "long")
        assert short.prefill_worker == short.decode_worker == "decode-0"  # local prefill
        assert long_info.prefill_worker == "prefill-0" and long_info.prompt_tokens > 7000
        gateway = s.metrics_targets["gateway"]
        assert metric(gateway, "tandem:routing_decisions_total", reason="threshold") >= 1
        await assert_all_blocks_freed(s, timeout_s=30)

    with running(s):
        asyncio.run(run())


def test_a_slow_kv_handoff_keeps_a_prompt_on_an_idle_decode_worker():
    """Conditional disaggregation weighs the KV handoff the gateway measured for the pair: a
    prompt well over the threshold goes to the prefill worker while no handoff is known, and
    once two handoffs were slowed by 6 s (fault injection on the prefill worker's KV write)
    the same length of prompt is prefilled on the idle decode worker instead, by the
    ``queue`` rule: computing it there takes well under the handoff's expected seconds."""
    s = Stack(UpOptions(host="127.0.0.1", port=free_port(), num_prefill=1, num_decode=1,
                        redis_url=None,
                        worker_args=["--num-threads", "1", "--kv-cache-gib", "1", "--heartbeat-s",
                                     "0.5"],
                        gateway_args=["--heartbeat-s", "0.5", "--pd-threshold-tokens", "64"],
                        env={"TANDEM_TEST_FAULT_INJECTION": "1"}, ready_timeout_s=300))

    async def known_costs() -> bool:
        """Both workers' heartbeats carry a prompt token's measured cost."""
        workers = await registered_workers(s.redis_url)
        return len(workers) == 2 and all(w.prefill_seconds_per_token > 0 for w in workers)

    async def run():
        gateway = s.metrics_targets["gateway"]
        for i, words in enumerate((2, 50, 25)):  # under the threshold: on the decode worker
            await serve_prompt(s.address, " ".join(["cat"] * words), f"short-{i}")
        assert (await info_of(s.address, "short-1")).prefill_worker == "decode-0"
        await serve_prompt(s.address, document(0, 100), "before")  # ~200 tokens, no handoff known
        before = await info_of(s.address, "before")
        assert before.prompt_tokens > 150 and before.prefill_worker == "prefill-0"
        for i, words in enumerate((30, 70)):  # the prefill worker's cost, and two slow handoffs
            await serve_prompt(s.address, document(i + 1, words), f"slow-{i}+kv_write_delay=6")
        await wait_until(known_costs, 30, "both workers' prompt costs in their heartbeats")
        assert metric(gateway, "tandem:routing_decisions_total", reason="queue") == 0
        await serve_prompt(s.address, document(9, 100), "after")
        after = await info_of(s.address, "after")
        assert after.prompt_tokens > 150
        assert after.prefill_worker == after.decode_worker == "decode-0"  # local prefill
        assert metric(gateway, "tandem:routing_decisions_total", reason="queue") == 1
        await assert_all_blocks_freed(s, timeout_s=30)

    with running(s):
        asyncio.run(run())
