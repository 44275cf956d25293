"""Same input, same output, through the whole stack (gateway, workers, KV transfer, real
processes): in the default precision (the built-in GGUF's Q4_1 weights, int8 activations) a
greedy request's token ids and logprobs (and its top-5 alternatives) are the same bits, and so
are a seeded sampled request's (temperature 0.8, seed 2028: the sampler's draw for output
token i is a function of (seed, i), services/engine/sampler.py),

- alone on a cold cache (the reference),
- again with its prefix cached (usage.cached_tokens > 0),
- inside a batch of 16 other requests,
- after its decode worker is killed mid-stream and the gateway migrates it to the other one,
- with its prompt computed in chunks of 7 tokens (a 7-token step budget),
- after a preemption (a KV cache too small for the batch: recomputed from its tokens so far).

Two stacks: 1 prefill + 2 decode workers with the default settings, and one unified worker
with a 7-token step budget and 16 KV blocks. The engine-level checks are
tests/unit/test_batch_invariance.py, the kernels' tests/kernels/test_batch_invariance.py.
"""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import grpc
import pytest

from services.api import gateway_pb2, gateway_pb2_grpc, worker_pb2
from services.runtime.launcher import Stack, UpOptions
from tests.integration.conftest import (WORKER_ARGS, free_port, registered_workers, running,
                                        wait_until, worker_loads)

pytestmark = pytest.mark.integration

DEFAULT_PRECISION = ["--dtype", "auto", "--quantization", "auto"]
MAX_TOKENS = 32
PROMPT = ("The history of the printing press begins in the fifteenth century, when a goldsmith "
          "in Mainz combined movable metal type, oil-based ink and a wooden press adapted from")
# each kind's own prompt, so that each reference runs on a cold cache
KINDS = {"greedy": (PROMPT, {"temperature": 0.0}),
         "seeded": ("In 1687 Isaac Newton published the Principia, a book in three parts that set "
                    "out the laws of motion and universal gravitation, and explained",
                    {"temperature": 0.8, "seed": 2028})}
OTHERS = [f"Question {i}: name {i + 2} facts about the river that flows through city number "
          f"{i * 7}, and explain why" + " in detail" * (i % 5) for i in range(16)]


def request(prompt: str, request_id: str, max_tokens: int = MAX_TOKENS,
            **sampling) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(request_id=request_id, prompt=prompt, max_tokens=max_tokens,
                                       ignore_eos=True, logprobs=True, top_logprobs=5,
                                       **{"temperature": 0.0, **sampling})


def probe(kind: str, request_id: str) -> gateway_pb2.GenerateRequest:
    """The request under test, of ``kind`` (KINDS)."""
    prompt, sampling = KINDS[kind]
    return request(prompt, f"{kind}-{request_id}", **sampling)


async def generate(address: str, req: gateway_pb2.GenerateRequest, progress: list | None = None):
    """(token ids, per token (logprob, top 5 as (id, logprob))), and the last message."""
    tokens, logprobs, last = [], [], None
    async with grpc.aio.insecure_channel(address) as channel:
        async for msg in gateway_pb2_grpc.GatewayStub(channel).Generate(req, timeout=300):
            tokens.extend(msg.token_ids)
            logprobs.extend((lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs])
                            for lp in msg.logprobs)
            if progress is not None:
                progress.extend(msg.token_ids)
            last = msg
    assert last.finish_reason == "length" and len(tokens) == req.max_tokens == len(logprobs)
    return (tokens, logprobs), last


async def record(address: str, request_id: str) -> gateway_pb2.RequestInfo:
    async with grpc.aio.insecure_channel(address) as ch:
        return await gateway_pb2_grpc.GatewayStub(ch).GetRequest(
            gateway_pb2.GetRequestRequest(request_id=request_id), timeout=10)


@pytest.fixture(scope="module")
def pd_stack(redis_server) -> Iterator[Stack]:
    """1 prefill + 2 decode workers, default settings and precision."""
    with running(Stack(UpOptions(
            host="127.0.0.1", port=free_port(), num_prefill=1, num_decode=2,
            redis_url=redis_server.url, worker_args=[*WORKER_ARGS, *DEFAULT_PRECISION],
            gateway_args=["--heartbeat-s", "0.5"], ready_timeout_s=240))) as s:
        yield s


@pytest.fixture(scope="module")
def reference(pd_stack) -> dict[str, tuple[list[int], list]]:
    """Each kind's request alone on the fresh stack: nothing cached."""
    out = {}
    for kind in KINDS:
        out[kind], last = asyncio.run(generate(pd_stack.address, probe(kind, "alone")))
        assert last.usage.cached_tokens == 0
    assert out["seeded"][0] != out["greedy"][0]
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cached(pd_stack, reference, kind):
    out, last = asyncio.run(generate(pd_stack.address, probe(kind, "cached")))
    assert last.usage.cached_tokens > 0
    assert out == reference[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_inside_a_batch_of_16_others(pd_stack, reference, kind):
    """Among 16 others (half of them sampled with seeds of their own)."""
    async def run():
        others = [generate(pd_stack.address, request(
            p, f"{kind}-other-{i}", 24 + i, **({"temperature": 1.0, "seed": i} if i % 2 else {})))
            for i, p in enumerate(OTHERS)]
        results = await asyncio.gather(*others[:8], generate(pd_stack.address,
                                                             probe(kind, "batched")),
                                       *others[8:])
        return results[8][0]
    assert asyncio.run(run()) == reference[kind]


def test_after_migration_to_another_decode_worker(pd_stack, reference):
    """For each kind in turn, the decode worker streaming the request is killed after 4 tokens;
    the gateway sends prompt + tokens so far to the other decode worker, which computes them
    as a prefill and goes on (a seeded request draws its next token at its next index). A new
    decode worker then joins, so the next kind has a worker to migrate to."""
    async def migrated(kind: str) -> tuple[list[int], list]:
        progress: list[int] = []
        req = probe(kind, "migrated")
        stream = asyncio.ensure_future(generate(pd_stack.address, req, progress))

        async def streaming():
            return len(progress) >= 4
        await wait_until(streaming, 120, "4 tokens streamed", poll_s=0.01)
        victim = (await record(pd_stack.address, req.request_id)).decode_worker
        pd_stack.process(victim).send_signal(signal.SIGKILL)
        assert len(progress) < MAX_TOKENS - 4, "decoding finished before the kill"
        out, _ = await stream
        info = await record(pd_stack.address, req.request_id)
        assert info.decode_worker and info.decode_worker != victim
        return out

    async def joined(worker_id: str):
        return worker_id in {w.worker_id for w in await registered_workers(pd_stack.redis_url)}

    for n, kind in enumerate(KINDS):
        assert asyncio.run(migrated(kind)) == reference[kind], kind
        pd_stack.add_worker("decode", f"decode-new-{n}")
        asyncio.run(wait_until(lambda: joined(f"decode-new-{n}"), 180, "a new decode worker"))


@pytest.fixture(scope="module")
def small_stack() -> Iterator[Stack]:
    """One unified worker: a 7-token step budget, 16 KV blocks of 16 tokens (its own Redis:
    the other stack's workers must not join its registry)."""
    with running(Stack(UpOptions(
            host="127.0.0.1", port=free_port(), num_prefill=0, num_decode=0, num_unified=1,
            redis_url=None,
            worker_args=[*WORKER_ARGS, *DEFAULT_PRECISION, "--max-num-batched-tokens", "7",
                         "--num-kv-blocks", "16"],
            gateway_args=["--heartbeat-s", "0.5"], ready_timeout_s=240))) as s:
        yield s


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_chunked_by_7_tokens(small_stack, reference, kind):
    out, last = asyncio.run(generate(small_stack.address, probe(kind, "chunked")))
    assert last.usage.cached_tokens == 0 and last.usage.prompt_tokens > 14
    assert out == reference[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_after_preemption(small_stack, reference, kind):
    """4 others arrive first, then the request: when the 16 blocks cannot hold everyone's
    growing KV, the scheduler preempts the newest running request (its blocks freed, back to
    the queue) and recomputes it later from its prompt and output so far, in chunks of 7.

    The pressure lasts, whenever the request arrives: the 4 others would need 4 x 8 blocks, so
    they preempt one another until they finish, and the request, newest whenever it runs among
    them, is the first to go. Its own count comes from the worker's load report."""
    async def held() -> dict[str, worker_pb2.RequestLoad]:
        loads = await worker_loads(small_stack)
        return {r.request_id: r for load in loads.values() for r in load.requests}

    async def run():
        pressure = [request(p, f"{kind}-pressure-{i}", 100) for i, p in enumerate(OTHERS[:4])]
        others = [asyncio.ensure_future(generate(small_stack.address, r)) for r in pressure]

        async def all_held():
            return {r.request_id for r in pressure} <= (await held()).keys()
        await wait_until(all_held, 60, "the others at the worker", poll_s=0.01)
        req = probe(kind, "preempted")
        target = asyncio.ensure_future(generate(small_stack.address, req))
        stages, num_preemptions = [], 0
        while not target.done():
            now = (await held()).get(req.request_id)
            if now and (not stages or stages[-1] != now.stage):
                stages.append(now.stage)
            num_preemptions = max(num_preemptions, now.num_preemptions if now else 0)
            await asyncio.sleep(0.02)
        await asyncio.gather(*others)
        return (await target)[0], stages, num_preemptions
    preempted_before = preemptions(small_stack)
    out, stages, num_preemptions = asyncio.run(run())
    assert num_preemptions > 0, stages
    assert preemptions(small_stack) >= preempted_before + num_preemptions
    assert any(stage in ("prefilling", "decoding") for stage in stages), stages
    assert out == reference[kind]


def preemptions(stack: Stack) -> float:
    """The unified worker's preemption counter (its /metrics)."""
    from tests.integration.test_routing import metric

    return metric(stack.metrics_targets["unified-0"], "tandem:num_preemptions_total")
