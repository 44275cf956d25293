"""`tandem up` supervises its children as Kubernetes would (issue 10, items 5 and 6): a killed
decode worker is restarted under the same id while its streams migrate and finish exactly as
uninterrupted ones; a killed Redis is restarted on the same port with the same password and
serves again; a child that keeps dying stops the stack with a message naming it.

The stack is started as a person starts it (``python -m services.runtime.cli up``) and observed from
outside. Every wait is on a condition with a deadline; nothing asserts how long anything took.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time

import grpc
import pytest
import redis.asyncio as aioredis

from services.api import gateway_pb2, gateway_pb2_grpc
from services.state.redis_server import start_redis_server
from services.state.registry import WorkerRegistry
from tests.integration.conftest import WORKER_ARGS, free_port
from tests.integration.up_process import UpProcess, env_without_redis_url, wait_until, zombies_of

pytestmark = pytest.mark.integration
PROMPTS = ["Name three colours.", "Count from one to ten.", "What is a river?",
           "Write one sentence about the sea."]
MAX_TOKENS = 48


def chat(prompt: str, request_id: str, max_tokens: int = MAX_TOKENS) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        request_id=request_id, messages=[gateway_pb2.ChatMessage(role="user", content=prompt)],
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def stream(channel, request, progress: list[int]) -> gateway_pb2.GenerateResponse:
    last = None
    async for msg in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=300):
        progress.extend(msg.token_ids)
        last = msg
    return last


async def registered(redis_url: str, role: str) -> dict[str, str]:
    """worker id -> endpoint of the live workers of ``role``."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        return {w.worker_id: w.endpoint for w in await WorkerRegistry(client).list(role)}
    finally:
        await client.aclose()


async def wait_registered(redis_url: str, worker_id: str, not_endpoint: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        endpoint = (await registered(redis_url, "decode")).get(worker_id)
        if endpoint and endpoint != not_endpoint:
            return endpoint
        assert time.monotonic() < deadline, f"{worker_id} not back in the registry in {timeout_s}s"
        await asyncio.sleep(0.2)


def test_killed_decode_worker_is_restarted_while_its_streams_migrate():
    redis = start_redis_server(password=secrets.token_urlsafe(16))  # REDIS_URL with a password
    port = free_port()
    up = UpProcess(["--port", str(port), "--num-decode", "2", *WORKER_ARGS],
                   env={**os.environ, "REDIS_URL": redis.url})
    address = f"127.0.0.1:{port}"
    try:
        up.wait_ready(300)
        assert redis.password not in up.log

        async def run():
            async with grpc.aio.insecure_channel(address) as ch:
                reference = [[] for _ in PROMPTS]
                await asyncio.gather(*(stream(ch, chat(p, f"ref-{i}"), reference[i])
                                       for i, p in enumerate(PROMPTS)))
                progress = [[] for _ in PROMPTS]
                calls = [asyncio.ensure_future(stream(ch, chat(p, f"kill-{i}"), progress[i]))
                         for i, p in enumerate(PROMPTS)]
                while min(len(p) for p in progress) < 4:
                    assert not any(c.done() and c.exception() for c in calls), calls
                    await asyncio.sleep(0.02)
                info = await gateway_pb2_grpc.GatewayStub(ch).GetRequest(
                    gateway_pb2.GetRequestRequest(request_id="kill-0"), timeout=10)
                victim = info.decode_worker
                old_endpoint = (await registered(redis.url, "decode"))[victim]
                os.kill(up.pid_of(victim), signal.SIGKILL)
                assert len(progress[0]) < MAX_TOKENS, "decoding finished before the kill"
                lasts = await asyncio.gather(*calls)
            for i, last in enumerate(lasts):
                assert progress[i] == reference[i], i  # no gap, no repeat: as uninterrupted
                assert len(reference[i]) == MAX_TOKENS and last.finish_reason == "length"
            return victim, old_endpoint

        victim, old_endpoint = asyncio.run(run())
        asyncio.run(wait_registered(redis.url, victim, old_endpoint, 240))
        assert f"{victim} exited with code -9; restarting it" in up.log
        assert up.proc.poll() is None, "tandem up stopped"
        assert len(up.children()) == 4  # gateway, prefill-0, decode-0, decode-1
        assert zombies_of(up.proc.pid) == []
        assert up.stop() == 0, up.log[-4000:]  # the end of the log: what did not stop
    finally:
        up.proc.kill()
        up.proc.wait()
        redis.stop()


async def generate_until_ok(address: str, request_id: str, timeout_s: float) -> list[int]:
    """A new request, retried while the stack recovers (UNAVAILABLE), until it succeeds."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as ch:
        for attempt in range(10**6):
            tokens: list[int] = []
            try:
                await stream(ch, chat(PROMPTS[0], f"{request_id}-{attempt}", 8), tokens)
                return tokens
            except grpc.aio.AioRpcError as exc:  # while Redis and the registry come back
                assert time.monotonic() < deadline, f"no request succeeded: {exc.code()} {exc.details()}"
                await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


def test_killed_redis_is_restarted_and_a_crash_loop_stops_the_stack():
    port = free_port()
    up = UpProcess(["--port", str(port), *WORKER_ARGS, "--restart-limit", "2",
                    "--restart-window-s", "600", "--restart-backoff-s", "0.1"],
                   env=env_without_redis_url())
    address = f"127.0.0.1:{port}"
    try:
        up.wait_ready(300)
        before = asyncio.run(generate_until_ok(address, "before", 60))
        password = up.settings()["state"]["redis_url"].split(":")[2].split("@")[0]
        assert password and password not in up.log

        (first,) = up.redis_pids()
        os.kill(first, signal.SIGKILL)
        (second,) = wait_until(lambda: [p for p in up.redis_pids() if p != first], 60,
                               "redis-server to be restarted on the same port")
        assert asyncio.run(generate_until_ok(address, "after", 120)) == before
        assert "redis-server exited with code -9; restarting it" in up.log
        assert zombies_of(up.proc.pid) == []

        os.kill(second, signal.SIGKILL)  # the second restart: the limit
        (third,) = wait_until(lambda: [p for p in up.redis_pids() if p not in (first, second)], 60,
                              "redis-server to be restarted again")
        os.kill(third, signal.SIGKILL)  # a third death within the window: a crash loop
        wait_until(lambda: up.proc.poll() is not None, 120, "tandem up to stop")
        up._reader.join(timeout=10)
        assert up.proc.returncode == 1
        assert ("tandem up: error: redis-server keeps exiting (last exit code -9; restarted 2 "
                "times within 600s): stopping the stack") in up.log
        wait_until(lambda: not up.children() and not up.redis_pids(), 30, "every child to stop")
    finally:
        up.proc.kill()
        up.proc.wait()
