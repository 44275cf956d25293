"""Failure semantics on a real stack: processes killed with SIGKILL, cancellation at every stage,
lease expiry, failed and timed-out KV transfers under both policies, Redis stopped and started,
an overload burst. After each test every live worker process reports zero used KV blocks.

Every greedy output is compared with transformers' (``tests/reference.py``, stored), the stack's
uninterrupted outputs included. Stages are read from the workers' own per-request state
(``GetLoad``), and each cancellation is checked against how the decode worker's reservation
closed, so that neither natural completion nor the lease can pass for a working cancel.

One stack for the module: 2 prefill + 2 decode workers with a 3 s lease, a gateway with the
``recompute`` policy (at most 8 requests in flight) and one with ``fail``, its own Redis (so the
outage test can stop it), and the test-only fault hooks on (tags in request ids, see
services/prefill/faults.py).
"""
from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.auth import internal_channel
from services.api import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.runtime.launcher import Stack, UpOptions
from services.state.redis_server import RedisServer, start_redis_server
from services.state.registry import WorkerInfo, WorkerRegistry
from tests.integration import conftest as common
from tests.integration.conftest import WORKER_ARGS, free_port, wait_until, worker_loads
from tests.reference import CHAT_PROMPTS, NUM_TOKENS, chat_prompt_ids, hf_greedy_outputs

pytestmark = pytest.mark.integration

LEASE_S = 3.0
HEARTBEAT_S = 0.5
MAX_WAITING = 8  # per worker
MAX_INFLIGHT = 8  # gateway "recompute"
CHUNK = 256  # --max-num-batched-tokens: prompt tokens one engine step computes
# ~1,500 tokens: 6 chunks, so the prompt is still being computed when it is cancelled
LONG_PROMPT = " ".join(f"item{i} is a number." for i in range(220))


class FaultStack:
    """The module's stack, its Redis (restartable on the same port) and its two gateways."""

    def __init__(self) -> None:
        self.redis: RedisServer = start_redis_server()
        self.fail_port = free_port()
        self.stack = Stack(UpOptions(
            host="127.0.0.1", port=free_port(), num_prefill=2, num_decode=2, redis_url=self.redis.url,
            worker_args=[*WORKER_ARGS, "--kv-lease-s", str(LEASE_S), "--max-waiting", str(MAX_WAITING),
                         "--max-num-batched-tokens", "256"],
            gateway_args=["--heartbeat-s", str(HEARTBEAT_S), "--max-inflight", str(MAX_INFLIGHT)],
            env={"TANDEM_TEST_FAULT_INJECTION": "1"}, ready_timeout_s=240))

    @property
    def address(self) -> str:  # kv failure policy: recompute
        return self.stack.address

    @property
    def fail_address(self) -> str:  # kv failure policy: fail
        return f"127.0.0.1:{self.fail_port}"

    def start(self) -> None:
        self.stack.start()
        self.stack.add_gateway("gateway-fail", self.fail_port,
                               ["--kv-failure-policy", "fail", "--max-inflight", "64"])
        self.stack.wait_ready()
        asyncio.run(wait_serving(self.fail_address, 60))

    def stop(self) -> None:
        self.stack.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def fs() -> Iterator[FaultStack]:
    s = FaultStack()
    try:
        s.start()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def greedy(fs) -> list[list[int]]:
    """Transformers' greedy outputs (NUM_TOKENS tokens) of CHAT_PROMPTS (``hf_greedy_outputs``,
    stored), after checking that this stack, with its own settings (256-token prefill budget,
    3 s lease), gives exactly them uninterrupted."""
    reference = [list(t) for t in hf_greedy_outputs()]

    async def run():
        return await asyncio.gather(*(generate(fs.address, chat(p, f"reference-{i}", NUM_TOKENS))
                                      for i, p in enumerate(CHAT_PROMPTS)))

    outputs = [tokens for tokens, _ in asyncio.run(run())]
    assert outputs == reference, "the fault stack's uninterrupted greedy output is not transformers'"
    return reference


# -- helpers -----------------------------------------------------------------------------------
def chat(prompt: str, request_id: str, max_tokens: int, **options) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        request_id=request_id, messages=[gateway_pb2.ChatMessage(role="user", content=prompt)],
        max_tokens=max_tokens, ignore_eos=True, **{"temperature": 0.0, **options})


async def generate(address: str, request: gateway_pb2.GenerateRequest):
    """(token ids, last message) of one streamed request."""
    async with grpc.aio.insecure_channel(address) as channel:
        tokens, last = [], None
        async for msg in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=120):
            tokens.extend(msg.token_ids)
            last = msg
        return tokens, last


async def wait_serving(address: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as ch:
        while True:
            try:
                resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            assert time.monotonic() < deadline, f"{address} not serving after {timeout_s}s"
            await asyncio.sleep(0.3)


async def workers(fs: FaultStack, role: str) -> list[WorkerInfo]:
    client = aioredis.Redis.from_url(fs.redis.url)
    try:
        return await WorkerRegistry(client).list(role)
    finally:
        await client.aclose()


async def assert_all_blocks_freed(fs: FaultStack, timeout_s: float = LEASE_S + 5) -> None:
    """Every live worker process answers GetLoad (any RPC error fails) and reaches zero used KV
    blocks and no requests within ``timeout_s`` seconds."""
    await common.assert_all_blocks_freed(fs.stack, timeout_s)


async def held(fs: FaultStack, role: str, request_id: str) -> dict[str, worker_pb2.RequestLoad]:
    """``request_id`` as each live ``role`` worker holding it reports it, by worker id."""
    return {w: r for w, l in (await worker_loads(fs.stack)).items() if w.startswith(role)
            for r in l.requests if r.request_id == request_id}


async def closed_reservation(fs: FaultStack, request_id: str) -> worker_pb2.ClosedReservation | None:
    """How a decode worker's reservation for ``request_id`` closed, once it has."""
    for w, l in (await worker_loads(fs.stack)).items():
        for c in l.closed_reservations if w.startswith("decode") else ():
            if c.request_id == request_id:
                return c
    return None


async def record(fs: FaultStack, request_id: str) -> gateway_pb2.RequestInfo:
    async with grpc.aio.insecure_channel(fs.address) as ch:
        return await gateway_pb2_grpc.GatewayStub(ch).GetRequest(
            gateway_pb2.GetRequestRequest(request_id=request_id), timeout=5)


async def wait_record(fs: FaultStack, request_id: str, pred, timeout_s: float = 10) -> gateway_pb2.RequestInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = await record(fs, request_id)
            if pred(info):
                return info
        except grpc.aio.AioRpcError:
            info = None
        assert time.monotonic() < deadline, f"{request_id}: record {info}"
        await asyncio.sleep(0.05)


async def open_reservation(w: WorkerInfo, channel, request_id: str, policy: int, max_tokens: int = 8):
    """A Decode stream opened straight on a decode worker, and its reservation."""
    call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(worker_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=chat_prompt_ids(CHAT_PROMPTS[0]),
        sampling_params=worker_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0,
                                                  ignore_eos=True, repetition_penalty=1.0),
        kv_failure_policy=policy), timeout=60)
    first = await call.read()
    r = first.reservation  # blocks to be written, after those the worker holds cached already
    assert first.HasField("reservation") and len(r.block_ids) + r.num_cached_blocks == 3
    assert first.reservation.lease_s == LEASE_S
    return call


# -- leases ------------------------------------------------------------------------------------
def test_unused_reservation_is_held_until_its_lease_ends_or_it_is_released_unused(fs):
    async def orphan(d: WorkerInfo, ch, how: str) -> None:
        call = await open_reservation(d, ch, f"lease-{how}", worker_pb2.KV_FAILURE_POLICY_FAIL)
        if how == "disconnect":
            call.cancel()
        else:  # a worker Abort ends the stream, but a prefill worker might still write
            resp = await worker_pb2_grpc.DecodeWorkerStub(ch).Abort(
                worker_pb2.WorkerAbortRequest(request_id=f"lease-{how}"), timeout=5)
            assert resp.found
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.ABORTED

    async def run():
        decode = await workers(fs, "decode")
        async with internal_channel(decode[0].endpoint, fs.stack.internal_secret) as c0, \
                internal_channel(decode[1].endpoint, fs.stack.internal_secret) as c1:
            t0 = time.monotonic()
            await asyncio.gather(orphan(decode[0], c0, "disconnect"), orphan(decode[1], c1, "abort"))

            async def quarantined():  # each worker's own state: stream gone, 3 blocks held
                on = {**await held(fs, "decode", "lease-disconnect"), **await held(fs, "decode", "lease-abort")}
                return sorted((r.stage, r.num_kv_blocks) for r in on.values()) == [("quarantined", 3)] * 2
            await wait_until(quarantined, LEASE_S, "both reservations quarantined")
            await assert_all_blocks_freed(fs, timeout_s=LEASE_S + 5)
            assert time.monotonic() - t0 >= LEASE_S - 0.5  # held until the lease ended
            for rid in ("lease-disconnect", "lease-abort"):
                assert (await closed_reservation(fs, rid)).outcome == "expired", rid

            call = await open_reservation(decode[0], c0, "lease-unused", worker_pb2.KV_FAILURE_POLICY_FAIL)
            resp = await worker_pb2_grpc.DecodeWorkerStub(c0).Abort(worker_pb2.WorkerAbortRequest(
                request_id="lease-unused", reservation_unused=True), timeout=5)
            assert resp.found
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.ABORTED
            await assert_all_blocks_freed(fs)
            assert (await closed_reservation(fs, "lease-unused")).outcome == "unused"  # not the lease

    asyncio.run(run())


def test_lease_end_on_a_waiting_stream_applies_the_failure_policy(fs, greedy):
    async def fail(ch, d):
        call = await open_reservation(d, ch, "lease-fail", worker_pb2.KV_FAILURE_POLICY_FAIL)
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert "lease" in err.value.details() and "fail" in err.value.details()
        assert time.monotonic() - t0 >= LEASE_S - 0.5
        assert (await closed_reservation(fs, "lease-fail")).outcome == "expired"

    async def recompute(ch, d):
        call = await open_reservation(d, ch, "lease-recompute", worker_pb2.KV_FAILURE_POLICY_RECOMPUTE)
        tokens = []
        while (msg := await call.read()) is not grpc.aio.EOF:
            tokens.extend(msg.token_ids)
        assert tokens == greedy[0][:8]  # computed locally in the reserved blocks
        assert (await closed_reservation(fs, "lease-recompute")).outcome == "expired"

    async def run():
        d0, d1 = await workers(fs, "decode")
        async with internal_channel(d0.endpoint, fs.stack.internal_secret) as c0, internal_channel(d1.endpoint, fs.stack.internal_secret) as c1:
            await asyncio.gather(fail(c0, d0), recompute(c1, d1))
        await assert_all_blocks_freed(fs)

    asyncio.run(run())


# -- cancellation ------------------------------------------------------------------------------
async def _reach_stage(fs: FaultStack, stage: str, rid: str, call) -> int:
    """Return once the workers' own state shows ``rid`` in ``stage`` (the prefill worker's stage,
    with the decode worker's reservation waiting for its KV; or decoding): the tokens computed
    then by the worker that computes it."""
    if stage == "decoding":
        assert (await call.read()).token_ids

    async def there():
        on_d = list((await held(fs, "decode", rid)).values())
        if stage == "decoding":
            return [r.stage for r in on_d] == ["decoding"] and [r.num_computed_tokens + 1 for r in on_d]
        on_p = list((await held(fs, "prefill", rid)).values())
        if [r.stage for r in on_d] != ["waiting_for_kv"] or [r.stage for r in on_p] != [stage]:
            return None
        assert stage != "prefilling" or on_p[0].num_computed_tokens < on_p[0].num_prompt_tokens
        return [on_p[0].num_computed_tokens + 1]  # truthy even at 0
    [computed_plus_1] = await wait_until(there, 60, f"{rid} in stage {stage}", poll_s=0.02)
    return computed_plus_1 - 1


# a bound on waits whose outcome another assertion decides (what was computed, how the
# reservation closed): it only ends a wait that would never end. NOTE: under a load average
# of 20 on 2 cores, one 256-token prefill step took over 8 s
HANG_S = 90.0
# tokens a cancelled request may still compute after it was last seen before the cancel:
# prefill, the step in flight and one that may have ended unseen (2 chunks of a 1.5k prompt);
# decode, the steps during the cancel's round trip (of 400 tokens it would generate)
COMPUTED_AFTER_CANCEL = {"prefill": 2 * CHUNK, "decode": 50}


async def _dropped_within_one_step(fs: FaultStack, role: str, rid: str, computed: int) -> None:
    """Wait until no ``role`` worker holds ``rid`` any more, checking that it stopped computing
    (``computed``: its computed tokens seen just before the cancel). NOTE: steps, not seconds:
    a step of 256 prompt tokens takes over a second on a loaded 2-core machine."""
    async def gone():
        on = list((await held(fs, role, rid)).values())
        assert all(r.num_computed_tokens <= computed + COMPUTED_AFTER_CANCEL[role] for r in on), (computed, on)
        return not on
    await wait_until(gone, HANG_S, f"{rid} dropped by the {role} worker")


async def _assert_cancel_reached_the_workers(fs: FaultStack, stage: str, rid: str, computed: int) -> None:
    """After the cancel: the workers stop the request and free its blocks, and the decode
    worker's reservation closes the way only a working cancellation explains."""
    if stage in ("queued", "prefilling"):
        # the prefill worker stops computing and frees its blocks: not at the end of its work
        # (+queue_delay=30 s, or a 1.5k-token prompt) nor at the lease's; then it tells the
        # decode worker, whose reservation closes before its lease would
        await _dropped_within_one_step(fs, "prefill", rid, computed)
        closed = await wait_until(lambda: closed_reservation(fs, rid), HANG_S, f"{rid}'s reservation closed")
        assert (closed.outcome, closed.reason) == ("not_written", "prefill cancelled"), closed
    elif stage == "transferring":  # the write may still land: the decode blocks stay held
        on_d = list((await held(fs, "decode", rid)).values())
        assert [r.stage for r in on_d] in (["quarantined"], ["waiting_for_kv"]), on_d
        # closed by the write's end, or by the lease when the prefill worker's notice comes later
        # (the write itself ends before the lease does): either way never freed while writable
        closed = await wait_until(lambda: closed_reservation(fs, rid), HANG_S, f"{rid}'s reservation closed")
        assert closed.outcome in ("landed", "not_written", "expired"), closed
    else:  # decoding
        await _dropped_within_one_step(fs, "decode", rid, computed)
    await wait_until(lambda: _not_held(fs, "decode", rid), HANG_S, f"{rid} dropped by the decode worker")


async def _not_held(fs: FaultStack, role: str, rid: str) -> bool:
    return not await held(fs, role, rid)


STAGES = {  # stage -> (request id tag, prompt as a chat message or raw text)
    "queued": ("+queue_delay=30", {"messages": CHAT_PROMPTS[1]}),
    "prefilling": ("", {"prompt": LONG_PROMPT}),
    "transferring": ("+kv_write_delay=1.5", {"messages": CHAT_PROMPTS[2]}),
    "decoding": ("", {"messages": CHAT_PROMPTS[3]}),
}


@pytest.mark.parametrize("how", ["abort", "disconnect"])
@pytest.mark.parametrize("stage", list(STAGES))
def test_cancel_at_every_stage_frees_every_block_and_records_aborted(fs, stage, how):
    tag, prompt = STAGES[stage]
    rid = f"cancel-{stage}-{how}{tag}"
    fields = dict(request_id=rid, max_tokens=400, temperature=0.0, ignore_eos=True)
    if "messages" in prompt:
        fields["messages"] = [gateway_pb2.ChatMessage(role="user", content=prompt["messages"])]
    else:
        fields["prompt"] = prompt["prompt"]

    async def run():
        async with grpc.aio.insecure_channel(fs.address) as ch:
            gateway = gateway_pb2_grpc.GatewayStub(ch)
            call = gateway.Generate(gateway_pb2.GenerateRequest(**fields), timeout=120)
            computed = await _reach_stage(fs, stage, rid, call)
            if how == "abort":
                assert (await gateway.Abort(gateway_pb2.AbortRequest(request_id=rid))).found
            else:
                call.cancel()
            await _assert_cancel_reached_the_workers(fs, stage, rid, computed)
            if how == "abort":
                msgs = []
                while (msg := await call.read()) is not grpc.aio.EOF:
                    msgs.append(msg)
                assert msgs and msgs[-1].finish_reason == "abort"
                assert sum(len(m.token_ids) for m in msgs) < 400
            info = await wait_record(fs, rid, lambda i: i.status in ("ABORTED", "FINISHED", "FAILED"))
            assert info.status == "ABORTED" and info.finish_reason == "abort"
        await assert_all_blocks_freed(fs)

    asyncio.run(run())


# -- KV transfer failures ----------------------------------------------------------------------
def test_failed_kv_transfer_recompute_finishes_and_fail_fails_cleanly(fs, greedy):
    async def run():
        expected = greedy[1][:10]
        tokens, last = await generate(fs.address, chat(CHAT_PROMPTS[1], "xfer-recompute+fail_kv_write", 10))
        assert tokens == expected and last.finish_reason == "length"
        assert (await record(fs, "xfer-recompute+fail_kv_write")).status == "FINISHED"
        closed = await closed_reservation(fs, "xfer-recompute+fail_kv_write")
        assert closed.outcome == "not_written" and "injected fault" in closed.reason, closed

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(fs.fail_address, chat(CHAT_PROMPTS[1], "xfer-fail+fail_kv_write", 10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "KV" in err.value.details() and "injected fault" in err.value.details()
        assert "policy: fail" in err.value.details()
        closed = await closed_reservation(fs, "xfer-fail+fail_kv_write")
        assert closed.outcome == "not_written", closed  # the prefill worker's notice, not the lease
        info = await record(fs, "xfer-fail+fail_kv_write")
        assert info.status == "FAILED" and "injected fault" in info.error
        await assert_all_blocks_freed(fs)

    asyncio.run(run())


def test_timed_out_kv_transfer_under_both_policies(fs, greedy):
    async def recompute():
        tokens, last = await generate(fs.address, chat(CHAT_PROMPTS[5], "slow-recompute+kv_write_delay=4", 10))
        assert tokens == greedy[5][:10] and last.finish_reason == "length"

    async def fail():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(fs.fail_address, chat(CHAT_PROMPTS[5], "slow-fail+kv_write_delay=4", 10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "lease" in err.value.details(), err.value.details()

    async def run():
        await asyncio.gather(recompute(), fail())
        assert (await record(fs, "slow-recompute+kv_write_delay=4")).status == "FINISHED"
        assert (await record(fs, "slow-fail+kv_write_delay=4")).status == "FAILED"
        for rid in ("slow-recompute+kv_write_delay=4", "slow-fail+kv_write_delay=4"):
            closed = await closed_reservation(fs, rid)
            # the lease's end; or, when a stalled event loop runs the prefill worker's notice
            # first (it comes only after the write gave up at the lease), that notice
            assert closed.outcome == "expired" or (
                closed.outcome == "not_written" and "lease" in closed.reason), closed
        await assert_all_blocks_freed(fs)

    asyncio.run(run())


# -- overload ----------------------------------------------------------------------------------
def test_overload_burst_is_bounded_and_every_admitted_request_finishes(fs, greedy):
    burst = 10 * MAX_INFLIGHT

    async def one(i: int):
        try:
            tokens, last = await generate(fs.address, chat(CHAT_PROMPTS[i % 8], f"burst-{i}", 4))
            return tokens, last
        except grpc.aio.AioRpcError as exc:
            return exc

    async def run():
        results = await asyncio.gather(*(one(i) for i in range(burst)))
        errors = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        done = [(i, r) for i, r in enumerate(results) if not isinstance(r, grpc.aio.AioRpcError)]
        assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errors), errors[:3]
        assert all("gateway overloaded" in e.details() for e in errors), errors[:3]  # its own bound
        assert errors and len(done) >= MAX_INFLIGHT, (len(errors), len(done))
        for i, (tokens, last) in done:
            assert tokens == greedy[i % 8][:4] and last.finish_reason == "length"
            assert (await record(fs, f"burst-{i}")).status == "FINISHED"
        # the workers' own high-water marks (every admission since they started)
        loads = await worker_loads(fs.stack)
        assert all(l.max_num_queued <= MAX_WAITING for l in loads.values()), {
            w: l.max_num_queued for w, l in loads.items()}
        assert all(0 < l.max_used_kv_blocks <= l.total_kv_blocks for l in loads.values())
        for name, proc in fs.stack.procs:
            assert proc.poll() is None, f"{name} died"

        # a worker's own bound: reservations beyond max_waiting are refused
        d = (await workers(fs, "decode"))[0]
        async with internal_channel(d.endpoint, fs.stack.internal_secret) as ch:
            opened = await asyncio.gather(*(
                open_reservation(d, ch, f"flood-{i}", worker_pb2.KV_FAILURE_POLICY_FAIL)
                for i in range(MAX_WAITING + 4)), return_exceptions=True)
            refused = [r for r in opened if isinstance(r, grpc.aio.AioRpcError)]
            assert len(refused) == 4 and all(
                r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused), refused
            assert (await worker_loads(fs.stack))[d.worker_id].max_num_queued == MAX_WAITING
            for i in range(MAX_WAITING + 4):
                await worker_pb2_grpc.DecodeWorkerStub(ch).Abort(worker_pb2.WorkerAbortRequest(
                    request_id=f"flood-{i}", reservation_unused=True), timeout=5)
        await assert_all_blocks_freed(fs)

    asyncio.run(run())


# -- Redis outage ------------------------------------------------------------------------------
def test_redis_outage_in_flight_requests_finish_new_ones_unavailable_then_recovers(fs, greedy):
    async def stream(ch, i: int, started: asyncio.Event):
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(chat(CHAT_PROMPTS[i], f"outage-{i}", 40), timeout=120)
        tokens = []
        async for msg in call:
            tokens.extend(msg.token_ids)
            started.set()
        return tokens

    async def run():
        async with grpc.aio.insecure_channel(fs.address) as ch:
            started = [asyncio.Event(), asyncio.Event()]
            streams = [asyncio.ensure_future(stream(ch, i, started[i])) for i in range(2)]
            for ev in started:
                await asyncio.wait_for(ev.wait(), 60)
            port = fs.redis.port
            fs.redis.stop()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(fs.address, chat(CHAT_PROMPTS[0], "outage-new", 4))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in err.value.details()
            results = await asyncio.gather(*streams)
            for i, tokens in enumerate(results):
                assert tokens == greedy[i], i  # finished while Redis was away

            fs.redis = start_redis_server(port=port)
            deadline = time.monotonic() + 20
            for n in range(1000):  # recovers by itself: workers re-register, the gateway reconnects
                try:
                    tokens, last = await generate(fs.address, chat(CHAT_PROMPTS[0], f"outage-after-{n}", 4))
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                    assert time.monotonic() < deadline, exc
                    await asyncio.sleep(0.25)
            assert tokens == greedy[0][:4]
            assert (await record(fs, f"outage-after-{n}")).status == "FINISHED"
        async def registered():
            return len(await workers(fs, "decode")) == 2 and len(await workers(fs, "prefill")) == 2
        await wait_until(registered, 30, "every worker registered again")
        await assert_all_blocks_freed(fs)

    asyncio.run(run())


# -- killed workers ----------------------------------------------------------------------------
async def _leaves_registry(fs: FaultStack, role: str, worker_id: str) -> None:
    """Call right after killing the worker: its registry entry has at most three heartbeat
    intervals to live, which nothing renews any more, and it goes."""
    client = aioredis.Redis.from_url(fs.redis.url)
    try:
        ttl_ms = await client.pttl(f"worker:{role}:{worker_id}")  # -2: gone already
    finally:
        await client.aclose()
    assert ttl_ms <= 3 * HEARTBEAT_S * 1000, ttl_ms

    async def gone():
        return worker_id not in {w.worker_id for w in await workers(fs, role)}
    await wait_until(gone, 30, f"{worker_id} gone from the registry")


def test_decode_worker_killed_mid_stream_migrates_without_gaps_and_new_workers_join(fs, greedy):
    """Stream 2 (the victim's) samples with a seed, stream 3 is greedy: after the migration
    both go on exactly as uninterrupted runs do (the seed's draws continue at the next output
    index on the new worker)."""
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 4242}
    options = {2: sampled, 3: {}}

    async def stream(ch, i: int, progress: list):
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(
            chat(CHAT_PROMPTS[i], f"migrate-{i}", 40, **options[i]), timeout=120)
        last = None
        async for msg in call:
            progress.extend(msg.token_ids)
            last = msg
        return last

    async def run():
        uninterrupted, _ = await generate(fs.address, chat(CHAT_PROMPTS[2], "sampled-reference",
                                                           40, **sampled))
        assert uninterrupted != greedy[2]  # it really sampled
        expected = {2: uninterrupted, 3: greedy[3]}
        async with grpc.aio.insecure_channel(fs.address) as ch:
            progress = {2: [], 3: []}
            streams = {i: asyncio.ensure_future(stream(ch, i, progress[i])) for i in progress}
            async def streaming():
                return min(len(p) for p in progress.values()) >= 4
            await wait_until(streaming, 60, "both streams past 4 tokens", poll_s=0.02)
            victim = (await record(fs, "migrate-2")).decode_worker
            fs.stack.process(victim).send_signal(signal.SIGKILL)
            gone = asyncio.ensure_future(_leaves_registry(fs, "decode", victim))
            assert len(progress[2]) < 30, "decoding finished before the kill"
            lasts = {i: await s for i, s in streams.items()}
        for i, last in lasts.items():
            assert progress[i] == expected[i], i  # no gap, no repeat, as uninterrupted
            assert last.finish_reason == "length" and last.usage.completion_tokens == 40
        info = await record(fs, "migrate-2")
        assert info.status == "FINISHED" and info.output_tokens == 40
        assert info.decode_worker and info.decode_worker != victim
        await gone

        fs.stack.add_worker("decode", "decode-new")
        deadline = time.monotonic() + 120
        while "decode-new" not in {w.worker_id for w in await workers(fs, "decode")}:
            assert time.monotonic() < deadline and fs.stack.process("decode-new").poll() is None
            await asyncio.sleep(0.5)
        used = set()
        for n in range(12):  # a prompt no worker holds: equally idle workers tie, chosen at random
            await generate(fs.address, gateway_pb2.GenerateRequest(
                prompt=f"{n} {time.time()} join", max_tokens=2, request_id=f"joined-{n}"))
            used.add((await record(fs, f"joined-{n}")).decode_worker)
            if "decode-new" in used:
                break
        assert "decode-new" in used, used
        await assert_all_blocks_freed(fs)

    asyncio.run(run())


def test_prefill_worker_killed_its_request_retries_on_another(fs, greedy):
    rid = "prefill-killed+queue_delay=2"

    async def run():
        request = asyncio.ensure_future(generate(fs.address, chat(CHAT_PROMPTS[4], rid, 12)))

        async def queued_on_a_prefill_worker():  # the worker's own state: held, not computed
            on_p = await held(fs, "prefill", rid)
            return [w for w, r in on_p.items() if r.stage == "queued"]
        [victim] = await wait_until(queued_on_a_prefill_worker, 60, f"{rid} queued", poll_s=0.02)
        fs.stack.process(victim).send_signal(signal.SIGKILL)
        gone = asyncio.ensure_future(_leaves_registry(fs, "prefill", victim))
        tokens, last = await request
        assert tokens == greedy[4][:12] and last.finish_reason == "length"
        after = await record(fs, rid)
        assert after.status == "FINISHED"
        assert after.prefill_worker and after.prefill_worker != victim
        await gone
        await assert_all_blocks_freed(fs)  # the first reservation: held until its lease ended

    asyncio.run(run())
