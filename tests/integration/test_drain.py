"""Rolling restarts on a real stack (issue 14): SIGTERM drains a worker or a gateway
(``services/runtime/drain.py``) and no client stream is lost.

- a decode worker with 8 greedy streams running: the streams still running at its (short)
  drain deadline migrate to the other decode worker; every stream equals transformers' greedy
  output (``tests/data/hf_greedy.json``);
- a prefill worker with prompts queued: they are handed back and computed by the other
  prefill worker; every stream equals the reference;
- a gateway with a stream open: ``/ready`` answers 503 and new requests UNAVAILABLE at once,
  the open stream completes (equal to an uninterrupted run of the same request).

Each drained process exits 0 within its bound (drain deadline + KV lease + a margin for
process exit on a loaded machine), and every remaining worker reports zero used KV blocks.

One stack for the module: 2 prefill + 2 decode workers (drain deadlines 0.5 s, lease 4 s, the
test-only fault hooks on for ``queue_delay``), its own Redis, a gateway.
"""
from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from services.api import gateway_pb2, gateway_pb2_grpc
from services.runtime.launcher import Stack, UpOptions
from services.state.redis_server import start_redis_server
from tests.integration.conftest import (
    WORKER_ARGS, assert_all_blocks_freed, free_port, registered_workers, running, wait_until,
    worker_loads)
from tests.reference import CHAT_PROMPTS, NUM_TOKENS, hf_greedy_outputs

pytestmark = pytest.mark.integration

LEASE_S = 4.0
DRAIN_S = 0.5  # both worker roles: short, so that what runs at the deadline is handed back
HEARTBEAT_S = 0.5
EXIT_MARGIN_S = 30.0  # process exit after the drain (gRPC stop, engine thread) on 2 busy cores


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    redis = start_redis_server()
    s = Stack(UpOptions(
        host="127.0.0.1", port=free_port(), num_prefill=2, num_decode=2, redis_url=redis.url,
        worker_args=[*WORKER_ARGS, "--kv-lease-s", str(LEASE_S), "--decode-drain-s", str(DRAIN_S),
                     "--prefill-drain-s", str(DRAIN_S)],
        gateway_args=["--heartbeat-s", str(HEARTBEAT_S)],
        env={"TANDEM_TEST_FAULT_INJECTION": "1"}, ready_timeout_s=240))
    try:
        with running(s):
            yield s
    finally:
        redis.stop()


def chat(prompt: str, request_id: str, max_tokens: int = NUM_TOKENS) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        request_id=request_id, messages=[gateway_pb2.ChatMessage(role="user", content=prompt)],
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def stream(address: str, request: gateway_pb2.GenerateRequest, progress: list[int]):
    """Stream ``request``, appending tokens to ``progress``; the last message."""
    last = None
    async with grpc.aio.insecure_channel(address) as ch:
        async for msg in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=180):
            progress.extend(msg.token_ids)
            last = msg
    return last


async def record(address: str, request_id: str) -> gateway_pb2.RequestInfo:
    async with grpc.aio.insecure_channel(address) as ch:
        return await gateway_pb2_grpc.GatewayStub(ch).GetRequest(
            gateway_pb2.GetRequestRequest(request_id=request_id), timeout=10)


class Drained:
    """SIGTERM ``proc`` now; a thread notes when it exits, so that a later check measures the
    drain and not the test's own waiting."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.exited_at = proc, None
        self.signalled_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        self.proc.wait()
        self.exited_at = time.monotonic()

    def assert_exit_0_within(self, bound_s: float) -> None:
        self._thread.join(timeout=max(1.0, self.signalled_at + bound_s - time.monotonic()))
        assert self.exited_at is not None, f"the drained process still runs {bound_s}s after SIGTERM"
        took = self.exited_at - self.signalled_at
        assert self.proc.returncode == 0, f"drained process exited with {self.proc.returncode}"
        assert took <= bound_s, f"drain took {took:.1f}s > {bound_s}s"


async def leaves_registry(stack: Stack, worker_id: str) -> None:
    async def gone():
        return worker_id not in {w.worker_id for w in await registered_workers(stack.redis_url)}
    await wait_until(gone, 10, f"{worker_id} gone from the registry")


def test_sigterm_decode_worker_migrates_running_streams_and_exits_0(stack):
    greedy = [list(t) for t in hf_greedy_outputs()]
    assert len(CHAT_PROMPTS) >= 8

    async def run():
        progress = {i: [] for i in range(8)}
        streams = {i: asyncio.ensure_future(stream(stack.address, chat(CHAT_PROMPTS[i], f"dd-{i}"), p))
                   for i, p in progress.items()}

        async def all_streaming():
            return min(len(p) for p in progress.values()) >= 2
        await wait_until(all_streaming, 120, "all 8 streams past 2 tokens", poll_s=0.02)
        on = {i: (await record(stack.address, f"dd-{i}")).decode_worker for i in progress}
        victim = max(set(on.values()), key=list(on.values()).count)
        mine = [i for i, w in on.items() if w == victim]
        drained = Drained(stack.process(victim))
        await leaves_registry(stack, victim)
        lasts = {i: await s for i, s in streams.items()}
        drained.assert_exit_0_within(DRAIN_S + LEASE_S + EXIT_MARGIN_S)
        for i, last in lasts.items():
            assert progress[i] == greedy[i], f"stream {i}: not the uninterrupted greedy output"
            assert last.finish_reason == "length" and last.usage.completion_tokens == NUM_TOKENS
        moved = [i for i in mine if (await record(stack.address, f"dd-{i}")).decode_worker != victim]
        assert moved, f"no stream of {victim} was migrated at its drain deadline ({mine})"
        await assert_all_blocks_freed(stack, LEASE_S + 10)

    asyncio.run(run())


def test_sigterm_prefill_worker_hands_back_queued_prompts_and_exits_0(stack):
    greedy = [list(t) for t in hf_greedy_outputs()]
    n_tokens = 8
    rids = [f"pd-{i}+queue_delay=3" for i in range(4)]  # held 3 s on a prefill worker

    async def run():
        progress = {rid: [] for rid in rids}
        streams = {rid: asyncio.ensure_future(stream(stack.address, chat(CHAT_PROMPTS[i], rid, n_tokens),
                                                     progress[rid]))
                   for i, rid in enumerate(rids)}

        async def queued_on_prefill():  # the workers' own state: held, not computed yet
            loads = await worker_loads(stack)
            return sorted({w for w, load in loads.items() if w.startswith("prefill")
                           for r in load.requests if r.request_id in rids and r.stage == "queued"})
        victim = (await wait_until(queued_on_prefill, 60, "prompts queued", poll_s=0.02))[0]
        held = [r.request_id for r in (await worker_loads(stack))[victim].requests]
        drained = Drained(stack.process(victim))
        lasts = {rid: await s for rid, s in streams.items()}
        # the injected 3 s queue delay is a sleep the hand-back cannot cut short
        drained.assert_exit_0_within(3 + DRAIN_S + LEASE_S + EXIT_MARGIN_S)
        for i, rid in enumerate(rids):
            assert progress[rid] == greedy[i][:n_tokens], rid
            assert lasts[rid].finish_reason == "length"
            info = await record(stack.address, rid)
            assert info.status == "FINISHED", rid
            if rid in held:  # handed back: computed by the other prefill worker
                assert info.prefill_worker and info.prefill_worker != victim, (rid, info.prefill_worker)
        await assert_all_blocks_freed(stack, LEASE_S + 10)

    asyncio.run(run())


def http_status(url: str) -> int | None:
    """The HTTP status of GET ``url``; None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def test_sigterm_gateway_fails_readiness_and_finishes_its_open_stream(stack):
    port, http_port = free_port(), free_port()
    proc = stack.add_gateway("gateway-drained", port, [
        "--http-port", str(http_port), "--heartbeat-s", str(HEARTBEAT_S), "--gateway-drain-s", "120"])
    address, ready_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}/ready"
    n_tokens = 160  # longer than the reference: compared with an uninterrupted run here

    async def run():
        async def ready():
            return http_status(ready_url) == 200
        await wait_until(ready, 120, "the new gateway ready", poll_s=0.2)
        reference: list[int] = []
        await stream(address, chat(CHAT_PROMPTS[1], "gd-reference", n_tokens), reference)
        progress: list[int] = []
        open_stream = asyncio.ensure_future(stream(address, chat(CHAT_PROMPTS[1], "gd-open", n_tokens), progress))

        async def streaming():
            return len(progress) >= 2
        await wait_until(streaming, 60, "the stream started", poll_s=0.02)
        drained = Drained(proc)

        async def not_ready():
            return http_status(ready_url) == 503
        await wait_until(not_ready, 10, "/ready 503 while draining", poll_s=0.02)
        assert not open_stream.done(), "the stream ended before the drain could be observed"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stream(address, chat(CHAT_PROMPTS[2], "gd-new", 4), [])
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        last = await open_stream
        assert progress == reference and last.finish_reason == "length"
        drained.assert_exit_0_within(120 + EXIT_MARGIN_S)

    asyncio.run(run())


def test_second_sigterm_cuts_a_long_drain_short(stack):
    """A decode worker with a 10 min drain deadline and a stream running: the first SIGTERM
    starts the drain (the stream goes on, new requests are refused), a second one hands the
    stream back at once (UNAVAILABLE: the gateway would migrate it) and the worker exits 0."""
    from services.auth import internal_channel
    from services.api import worker_pb2, worker_pb2_grpc
    from tests.reference import chat_prompt_ids

    proc = stack.add_worker("decode", "decode-slow", ["--decode-drain-s", "600"])

    async def run():
        async def registered():
            return {w.worker_id: w for w in await registered_workers(stack.redis_url)}.get("decode-slow")
        w = await wait_until(registered, 180, "decode-slow registered", poll_s=0.2)
        params = worker_pb2.SamplingParams(max_tokens=4000, temperature=0.0, top_p=1.0, ignore_eos=True,
                                           repetition_penalty=1.0)
        async with internal_channel(w.endpoint, stack.internal_secret) as ch:
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
            call = stub.Decode(worker_pb2.DecodeRequest(
                request_id="slow-0", prompt_token_ids=chat_prompt_ids(CHAT_PROMPTS[0]),
                sampling_params=params, local_prefill=True), timeout=600)
            tokens = []
            async for msg in call:
                tokens.extend(msg.token_ids)
                if len(tokens) >= 4:
                    break
            proc.send_signal(signal.SIGTERM)
            await leaves_registry(stack, "decode-slow")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Decode(worker_pb2.DecodeRequest(
                    request_id="slow-1", prompt_token_ids=chat_prompt_ids(CHAT_PROMPTS[1]),
                    sampling_params=params, local_prefill=True), timeout=30).read()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            before = len(tokens)
            async for msg in call:  # still streaming while it drains
                tokens.extend(msg.token_ids)
                if len(tokens) >= before + 4:
                    break
            assert len(tokens) >= before + 4
            drained = Drained(proc)  # the second SIGTERM
            with pytest.raises(grpc.aio.AioRpcError) as handed_back:
                async for msg in call:
                    tokens.extend(msg.token_ids)
            assert handed_back.value.code() == grpc.StatusCode.UNAVAILABLE, handed_back.value
            assert len(tokens) < 4000
        drained.assert_exit_0_within(LEASE_S + EXIT_MARGIN_S)

    asyncio.run(run())


def test_draining_prefill_worker_refuses_new_prompts_and_frees_their_reservation(stack):
    """A prefill worker (10 min deadline) draining with a prompt held: a new Prefill gets
    UNAVAILABLE and its decode worker hears "not written" at once (no block waits for the
    lease); the held prompt is still computed and its KV lands; then the worker exits 0."""
    from services.auth import internal_channel
    from services.api import worker_pb2, worker_pb2_grpc
    from tests.reference import chat_prompt_ids

    proc = stack.add_worker("prefill", "prefill-slow", ["--prefill-drain-s", "600"])
    greedy = [list(t) for t in hf_greedy_outputs()]
    params = worker_pb2.SamplingParams(max_tokens=4, temperature=0.0, top_p=1.0, ignore_eos=True,
                                       repetition_penalty=1.0)

    async def run():
        async def registered():
            by_id = {w.worker_id: w for w in await registered_workers(stack.redis_url)}
            return by_id.get("prefill-slow") and (by_id["prefill-slow"], [w for w in by_id.values() if w.role == "decode"][0])
        p, d = await wait_until(registered, 180, "prefill-slow registered", poll_s=0.2)
        async with internal_channel(p.endpoint, stack.internal_secret) as pch, \
                internal_channel(d.endpoint, stack.internal_secret) as dch:
            decode, prefill = worker_pb2_grpc.DecodeWorkerStub(dch), worker_pb2_grpc.PrefillWorkerStub(pch)

            async def reserve(rid: str, i: int):
                call = decode.Decode(worker_pb2.DecodeRequest(
                    request_id=rid, prompt_token_ids=chat_prompt_ids(CHAT_PROMPTS[i]), sampling_params=params), timeout=120)
                return call, (await call.read()).reservation

            def send_prefill(rid: str, i: int, reservation):
                return prefill.Prefill(worker_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=chat_prompt_ids(CHAT_PROMPTS[i]),
                    sampling_params=params, destination=reservation), timeout=120)

            held_rid = "ps-held+queue_delay=6"
            held_call, held_res = await reserve(held_rid, 0)
            held_prefill = asyncio.ensure_future(send_prefill(held_rid, 0, held_res))

            async def queued():
                load = (await worker_loads(stack))["prefill-slow"]
                return any(r.request_id == held_rid and r.stage == "queued" for r in load.requests)
            await wait_until(queued, 30, "the held prompt queued on prefill-slow", poll_s=0.02)
            drained = Drained(proc)
            await leaves_registry(stack, "prefill-slow")

            new_call, new_res = await reserve("ps-new", 1)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await send_prefill("ps-new", 1, new_res)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            load = await decode.GetLoad(worker_pb2.GetLoadRequest(), timeout=20)
            [closed] = [c for c in load.closed_reservations if c.request_id == "ps-new"]
            assert closed.outcome == "not_written" and "draining" in closed.reason, closed
            new_call.cancel()

            await held_prefill
            tokens = []
            while (msg := await held_call.read()) is not grpc.aio.EOF:  # read(): no mixing with async for
                tokens.extend(msg.token_ids)
            assert tokens == greedy[0][:4]
        drained.assert_exit_0_within(6 + LEASE_S + EXIT_MARGIN_S)  # the held prompt's 6 s queue delay
        await assert_all_blocks_freed(stack, LEASE_S + 10)

    asyncio.run(run())
