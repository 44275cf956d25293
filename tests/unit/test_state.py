"""Request-state store, worker registry and redis-server helpers, against a real redis-server."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from services.state.redis_server import check_redis, start_redis_server
from services.state.registry import Heartbeater, WorkerInfo, WorkerRegistry
from services.state.store import RequestState, RequestStateStore


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def store(client: aioredis.Redis) -> RequestStateStore:
    return RequestStateStore(client, ttl_s=60)


async def wait_for(predicate, timeout_s: float = 10.0, poll_s: float = 0.02) -> None:
    """Await ``predicate()`` until true. The deadline only ends a wait that would never end; no
    assertion here depends on how fast a loaded machine gets there."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(poll_s)


async def assert_pttl(client, key: str, ttl_ms: int, since: float) -> None:
    """``key`` expires ``ttl_ms`` after it was set, at or after ``since`` (time.monotonic()):
    what is left is within the time that has passed since then (holds however slow we are)."""
    pttl = await client.pttl(key)
    elapsed_ms = (time.monotonic() - since) * 1000
    assert ttl_ms - elapsed_ms - 1 <= pttl <= ttl_ms, (key, pttl, elapsed_ms)


# ---- request state -------------------------------------------------------------------------

async def test_create_and_get_decode_types(store: RequestStateStore, client) -> None:
    await store.create("r1", prompt_tokens=12, model="llama", arrival_time=1000.5)
    record = await store.get("r1")
    assert record == {"status": RequestState.QUEUED, "prompt_tokens": 12, "output_tokens": 0,
                      "model": "llama", "arrival_time": 1000.5}
    assert type(record["status"]) is RequestState
    assert type(record["prompt_tokens"]) is int and type(record["arrival_time"]) is float
    assert await client.ttl("request:r1") == -1  # live requests do not expire
    assert await store.get("missing") is None


async def test_create_defaults_arrival_to_now_and_rejects_duplicates(store) -> None:
    before = time.time()
    await store.create("r1", prompt_tokens=3, model="m")
    assert before <= (await store.get("r1"))["arrival_time"] <= time.time()
    with pytest.raises(KeyError, match="already exists"):
        await store.create("r1", prompt_tokens=5, model="m")
    assert (await store.get("r1"))["prompt_tokens"] == 3


async def test_transitions_write_status_and_timestamps(store, client) -> None:
    await store.create("r1", prompt_tokens=4, model="m", arrival_time=1.0)
    assert await store.transition("r1", RequestState.PREFILLING, prefill_worker="p0",
                                  prefill_start_time=2.0)
    assert await store.transition("r1", "decoding", decode_worker="d1", prefill_end_time=3,
                                  first_token_time=3.25, output_tokens=1)
    record = await store.get("r1")
    assert record["status"] is RequestState.DECODING
    assert record["prefill_worker"] == "p0" and record["decode_worker"] == "d1"
    assert (record["arrival_time"], record["prefill_start_time"], record["prefill_end_time"],
            record["first_token_time"]) == (1.0, 2.0, 3.0, 3.25)
    assert type(record["prefill_end_time"]) is float  # int input stored as float seconds
    assert "finish_time" not in record
    assert await client.ttl("request:r1") == -1


@pytest.mark.parametrize("terminal", [RequestState.FINISHED, RequestState.ABORTED,
                                      RequestState.FAILED])
async def test_terminal_status_sets_finish_time_and_ttl(store, client, terminal) -> None:
    await store.create("r1", prompt_tokens=4, model="m")
    before = time.time()
    await store.transition("r1", terminal, finish_reason="stop")
    record = await store.get("r1")
    assert record["status"] is terminal and record["finish_reason"] == "stop"
    assert before <= record["finish_time"] <= time.time()
    assert 59_000 < await client.pttl("request:r1") <= 60_000


async def test_given_finish_time_is_kept(store) -> None:
    await store.create("r1", prompt_tokens=4, model="m")
    await store.transition("r1", RequestState.FAILED, finish_time=42.0, error="worker died")
    record = await store.get("r1")
    assert record["finish_time"] == 42.0 and record["error"] == "worker died"


async def test_finished_request_expires(client) -> None:
    store = RequestStateStore(client, ttl_s=60)
    await store.create("r1", prompt_tokens=4, model="m")
    since = time.monotonic()
    await store.transition("r1", RequestState.FINISHED)
    await assert_pttl(client, "request:r1", 60_000, since)
    assert (await store.get("r1"))["status"] is RequestState.FINISHED

    store = RequestStateStore(client, ttl_s=0.2)
    await store.create("r2", prompt_tokens=4, model="m")
    await store.transition("r2", RequestState.FINISHED)
    await wait_for(lambda: _gone(store, "r2"))


async def _gone(store: RequestStateStore, request_id: str) -> bool:
    return await store.get(request_id) is None


async def test_terminal_state_is_final(store) -> None:
    await store.create("r1", prompt_tokens=4, model="m")
    assert await store.transition("r1", RequestState.ABORTED) is True
    assert await store.transition("r1", RequestState.DECODING, decode_worker="late") is False
    record = await store.get("r1")
    assert record["status"] is RequestState.ABORTED and "decode_worker" not in record


async def test_unknown_field_is_rejected_and_nothing_written(store) -> None:
    await store.create("r1", prompt_tokens=4, model="m")
    with pytest.raises(ValueError, match="'prefil_worker'"):
        await store.transition("r1", RequestState.PREFILLING, prefil_worker="p0")
    with pytest.raises(ValueError, match="'output_token'"):
        await store.update("r1", output_token=3)
    assert (await store.get("r1"))["status"] is RequestState.QUEUED


async def test_bad_values_are_rejected(store) -> None:
    await store.create("r1", prompt_tokens=4, model="m")
    with pytest.raises(ValueError, match="output_tokens must be int"):
        await store.update("r1", output_tokens="3")
    with pytest.raises(ValueError, match="first_token_time must be float"):
        await store.update("r1", first_token_time="soon")
    with pytest.raises(ValueError, match="status"):
        await store.transition("r1", "running")
    with pytest.raises(ValueError, match="transition"):
        await store.update("r1", status=RequestState.FINISHED)
    assert (await store.get("r1"))["status"] is RequestState.QUEUED


async def test_update_sets_and_removes_fields(store) -> None:
    await store.create("r1", prompt_tokens=4, model="m")
    await store.update("r1", output_tokens=7, decode_worker="d0")
    await store.update("r1", decode_worker=None)
    record = await store.get("r1")
    assert record["output_tokens"] == 7 and "decode_worker" not in record


async def test_writes_to_unknown_request_raise_and_create_nothing(store, client) -> None:
    with pytest.raises(KeyError):
        await store.transition("ghost", RequestState.FINISHED)
    with pytest.raises(KeyError):
        await store.update("ghost", output_tokens=1)
    assert await client.exists("request:ghost") == 0


async def test_store_works_with_decode_responses_client(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        store = RequestStateStore(client)
        await store.create("r1", prompt_tokens=2, model="m", arrival_time=5.0)
        await store.transition("r1", RequestState.FINISHED, output_tokens=9)
        record = await store.get("r1")
        assert record["output_tokens"] == 9 and record["status"] is RequestState.FINISHED
    finally:
        await client.aclose()


# ---- worker registry -----------------------------------------------------------------------

def worker(worker_id: str, role: str = "decode", **load: int) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, endpoint=f"10.0.0.1:{5000 + len(worker_id)}",
                      **load)


async def test_heartbeat_and_list(client) -> None:
    registry = WorkerRegistry(client, heartbeat_interval_s=1.0)
    before = time.time()
    await registry.heartbeat(worker("d2", free_kv_blocks=10, total_kv_blocks=64, num_running=3,
                                    num_waiting=1))
    since = time.monotonic()
    await registry.heartbeat(worker("d1"))
    await registry.heartbeat(worker("p1", role="prefill"))
    decode = await registry.list("decode")
    assert [w.worker_id for w in decode] == ["d1", "d2"]
    d2 = decode[1]
    assert (d2.role, d2.endpoint, d2.free_kv_blocks, d2.total_kv_blocks, d2.num_running,
            d2.num_waiting) == ("decode", "10.0.0.1:5002", 10, 64, 3, 1)
    assert before <= d2.last_heartbeat <= time.time()
    assert [w.worker_id for w in await registry.list("prefill")] == ["p1"]
    assert await registry.list("unified") == []  # a role of its own: decode workers not listed
    await assert_pttl(client, "worker:decode:d1", 3_000, since)
    with pytest.raises(ValueError, match="role"):
        await registry.list("prefil")


async def test_dead_worker_vanishes_after_three_intervals(client) -> None:
    registry = WorkerRegistry(client, heartbeat_interval_s=0.2)  # entries live 0.6 s
    since = time.monotonic()
    await registry.heartbeat(worker("d1"))
    await registry.heartbeat(worker("d2"))
    await assert_pttl(client, "worker:decode:d1", 600, since)

    async def d1_gone() -> bool:
        await registry.heartbeat(worker("d2"))  # d2 stays alive
        listed = [w.worker_id for w in await registry.list("decode")]
        assert "d2" in listed
        return listed == ["d2"]

    await wait_for(d1_gone)
    # never before three intervals: a slow check only ever sees it later
    assert time.monotonic() - since >= 0.6
    assert await client.smembers("workers:decode") == {b"d2"}  # d1 pruned from the set


async def test_deregister(client) -> None:
    registry = WorkerRegistry(client)
    await registry.heartbeat(worker("d1"))
    await registry.heartbeat(worker("d2"))
    await registry.deregister("decode", "d1")
    assert [w.worker_id for w in await registry.list("decode")] == ["d2"]
    assert await client.exists("worker:decode:d1") == 0
    assert await client.smembers("workers:decode") == {b"d2"}


async def test_heartbeater_publishes_load_and_deregisters_on_stop(client) -> None:
    registry = WorkerRegistry(client, heartbeat_interval_s=0.1)
    load = {"num_running": 0}
    beater = Heartbeater(registry, lambda: worker("d1", **load))
    beater.start()
    await wait_for(lambda: _listed(registry, "d1"))
    load["num_running"] = 5
    await wait_for(lambda: _running_is(registry, 5))
    first = (await registry.list("decode"))[0].last_heartbeat
    # kept alive by its heartbeats: listed with a heartbeat more than 3 intervals later
    await wait_for(lambda: _beat_after(registry, "d1", first + 0.5))
    await beater.stop()
    assert await registry.list("decode") == []


async def test_heartbeater_survives_redis_outage(caplog) -> None:
    caplog.set_level(logging.INFO, logger="services.state.registry")
    server = start_redis_server()
    port = server.port
    client = aioredis.Redis.from_url(server.url)
    registry = WorkerRegistry(client, heartbeat_interval_s=0.1)
    beats: list[float] = []
    beater = Heartbeater(registry, lambda: (beats.append(time.monotonic()), worker("d1"))[1])
    try:
        beater.start()
        await wait_for(lambda: _listed(registry, "d1"))
        server.stop()
        await wait_for(lambda: _true(not beater.healthy))
        tried = len(beats)
        await wait_for(lambda: _true(len(beats) >= tried + 3))  # it keeps trying, unhealthy
        assert not beater._task.done() and not beater.healthy
        # one warning per outage. NOTE: on a loaded machine a heartbeat may also miss its
        # 0.1 s interval before the stop: an outage too, so warnings and resumes alternate
        assert _outages(caplog)[-1] == "failed"

        server = start_redis_server(port=port)  # a fresh, empty Redis on the same port
        await wait_for(lambda: _listed(registry, "d1"))
        assert beater.healthy
        events = _outages(caplog)
        assert events[-1] == "resumed"
        assert events == ["failed", "resumed"] * (len(events) // 2), events
        await beater.stop()
        assert await registry.list("decode") == []
    finally:
        await beater.stop()
        await client.aclose()
        server.stop()


def _outages(caplog) -> list[str]:
    """The heartbeater's outage log in order: "failed" (a warning) and "resumed"."""
    return ["failed" if r.levelno == logging.WARNING else "resumed" for r in caplog.records
            if "heartbeat to Redis failed" in r.getMessage() or "resumed" in r.getMessage()]


async def _true(value: bool) -> bool:
    return value


async def _beat_after(registry: WorkerRegistry, worker_id: str, after: float) -> bool:
    return any(w.worker_id == worker_id and w.last_heartbeat > after
               for w in await registry.list("decode"))


async def _listed(registry: WorkerRegistry, worker_id: str) -> bool:
    try:
        return worker_id in [w.worker_id for w in await registry.list("decode")]
    except redis.exceptions.ConnectionError:  # a pooled connection from before a restart
        return False


async def _running_is(registry: WorkerRegistry, num_running: int) -> bool:
    return [w.num_running for w in await registry.list("decode")] == [num_running]


# ---- redis-server helpers ------------------------------------------------------------------

async def test_start_redis_server_runs_without_persistence() -> None:
    with start_redis_server() as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        await check_redis(server.url)
        client = aioredis.Redis.from_url(server.url, decode_responses=True)
        try:
            assert await client.config_get("save") == {"save": ""}
            assert await client.config_get("appendonly") == {"appendonly": "no"}
        finally:
            await client.aclose()
    assert server.process.returncode is not None
    with pytest.raises(ConnectionError):
        await check_redis(server.url, timeout_s=0.5)


def test_start_redis_server_on_taken_port_fails(redis_server) -> None:
    with pytest.raises(RuntimeError, match="exited"):
        start_redis_server(port=redis_server.port)


def test_start_redis_server_without_binary(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="redis-server") as info:
        start_redis_server()
    assert "apt-get install -y redis-server" in str(info.value)


async def test_check_redis_on_closed_port() -> None:
    with start_redis_server() as server:
        url = server.url
    with pytest.raises(ConnectionError, match=re.escape(url)):
        # the outer bound only ends a check that would hang; its own 1 s timeout must end it
        await asyncio.wait_for(check_redis(url, timeout_s=1.0), 30)


def test_without_redis_server_the_error_names_the_install_and_redis_url(monkeypatch):
    """`tandem up` in an image without redis-server: the message says what to do instead."""
    from services.state import redis_server

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match=r"`redis-server` was not found on PATH; install it "
                       r"with `apt-get install -y redis-server`.* or set REDIS_URL"):
        redis_server.start_redis_server()


class _CancelLosingRegistry:
    """A registry whose heartbeat turns the CancelledError it gets while waiting for Redis into
    a ConnectionError, as redis-py can while it closes the connection on the way out."""

    heartbeat_interval_s = 0.05

    def __init__(self) -> None:
        self.waiting = asyncio.Event()
        self.deregistered: list[str] = []
        self.loses = True  # False: the cancellation goes through (the test's clean-up)

    async def heartbeat(self, info: WorkerInfo) -> None:
        self.waiting.set()
        try:
            await asyncio.Event().wait()  # the reply never comes before the cancel
        except asyncio.CancelledError:
            if not self.loses:
                raise
            raise redis.exceptions.ConnectionError("connection closed while cancelling") from None

    async def deregister(self, role: str, worker_id: str) -> None:
        self.deregistered.append(worker_id)


async def test_heartbeater_stops_when_the_redis_client_loses_the_cancellation() -> None:
    """The drain awaits ``stop()``: it returns and deregisters even when the cancellation
    never reaches the heartbeat loop (a worker once kept beating and never exited)."""
    registry = _CancelLosingRegistry()
    beater = Heartbeater(registry, lambda: worker("d1"))
    beater.start()
    loop_task = beater._task
    await registry.waiting.wait()
    # NOTE: not wait_for: cancelling a stop() that waits on such a loop would hang as well
    stopping = asyncio.ensure_future(beater.stop())
    try:
        done, _ = await asyncio.wait({stopping}, timeout=5)
        assert done, "stop() did not return: the heartbeat loop outlived its cancellation"
        assert registry.deregistered == ["d1"]
        assert beater._task is None
    finally:  # a failed run must not leave the loop beating past the test
        registry.loses = False
        loop_task.cancel()
        await asyncio.wait({loop_task, stopping}, timeout=5)
