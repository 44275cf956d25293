"""services/runtime/drain.py's decisions on fakes (no processes, no sleeping on a clock): when a worker
hands back what it holds, what the gateway's readiness reports while draining, and that the
supervisor leaves a child that exited 0 (it drained on request) stopped. The real thing, with
processes and signals: tests/integration/test_drain.py."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from grpc_health.v1 import health_pb2

from services.runtime.drain import drain_gateway, drain_worker, wait_for
from services.gateway.health import ReadinessMonitor
from services.runtime.supervisor import RestartPolicy, Supervisor
from tests.unit.test_supervisor_policy import Clock, FakeUnit


class FakeServicer:
    """Holds ``held`` requests, each with one KV block, until ``hand_back``."""

    def __init__(self, runtime, held: int) -> None:
        self.rt, self.handed_back = runtime, 0
        for i in range(held):
            runtime.streams[f"r{i}"] = object()
        runtime.engine.block_manager.num_used_blocks = held

    def busy(self) -> bool:
        return bool(self.rt.streams)

    def hand_back(self) -> int:
        n, self.handed_back = len(self.rt.streams), self.handed_back + 1
        self.rt.streams.clear()
        self.rt.engine.block_manager.num_used_blocks = 0
        return n


def runtime(role: str = "decode"):
    return SimpleNamespace(options=SimpleNamespace(role=role, kv_lease_s=0.0), worker_id=f"{role}-0",
                           streams={}, engine=SimpleNamespace(block_manager=SimpleNamespace(num_used_blocks=0)))


def test_idle_worker_drains_without_handing_anything_back():
    rt = runtime()
    servicer = FakeServicer(rt, held=0)
    assert asyncio.run(drain_worker(rt, servicer, drain_s=60.0)) == 0
    assert servicer.handed_back == 0


def test_requests_still_held_at_the_deadline_are_handed_back_and_no_block_stays_used():
    for role in ("decode", "prefill"):
        rt = runtime(role)
        servicer = FakeServicer(rt, held=3)
        assert asyncio.run(drain_worker(rt, servicer, drain_s=0.0)) == 0
        assert servicer.handed_back == 1 and not rt.streams


def test_a_second_signal_hands_back_at_once():
    async def run():
        rt = runtime()
        servicer = FakeServicer(rt, held=2)
        hurry = asyncio.Event()
        hurry.set()  # the second SIGTERM came: a 1 h deadline is not waited for
        used = await asyncio.wait_for(drain_worker(rt, servicer, 3600.0, hurry), timeout=60)
        return used, servicer.handed_back

    assert asyncio.run(run()) == (0, 1)


def test_blocks_left_in_use_are_reported():
    rt = runtime()
    servicer = FakeServicer(rt, held=1)
    servicer.hand_back = lambda: 0  # a quarantined reservation that outlives the lease
    rt.streams.clear()
    assert asyncio.run(drain_worker(rt, servicer, drain_s=0.0)) == 1


def test_wait_for_ends_on_the_condition_or_on_hurry():
    async def run():
        hurry = asyncio.Event()
        hurry.set()
        return await wait_for(lambda: True, 0.0), await wait_for(lambda: False, 3600.0, hurry)

    assert asyncio.run(run()) == (True, False)


class FakeHealth:
    def __init__(self) -> None:
        self.status: dict[str, int] = {}

    async def set(self, name: str, status: int) -> None:
        self.status[name] = status


def test_gateway_drain_fails_readiness_refuses_new_requests_and_waits_for_open_streams():
    async def run():
        health = FakeHealth()
        readiness = ReadinessMonitor(SimpleNamespace(), health, ["tandem.v1.Gateway"], 1.0)
        readiness.ready = True
        core = SimpleNamespace(draining=False, num_inflight=0)
        left = await drain_gateway(readiness, core, drain_s=60.0)
        return readiness, health, core, left

    readiness, health, core, left = asyncio.run(run())
    assert core.draining and left == 0
    assert readiness.ready is False and readiness.reason.startswith("draining")
    assert set(health.status) == {"", "tandem.v1.Gateway"}
    assert set(health.status.values()) == {health_pb2.HealthCheckResponse.NOT_SERVING}


def test_gateway_drain_deadline_leaves_open_streams_to_the_server_stop():
    core = SimpleNamespace(draining=False, num_inflight=2)
    readiness = ReadinessMonitor(SimpleNamespace(), FakeHealth(), [], 1.0)
    assert asyncio.run(drain_gateway(readiness, core, drain_s=0.0)) == 2


def test_supervisor_leaves_a_child_that_exited_0_stopped_and_restarts_a_crashed_one():
    clock, drained, crashed = Clock(), FakeUnit("decode-0"), FakeUnit("prefill-0")
    sup = Supervisor(lambda: [drained, crashed],
                     RestartPolicy(restart_limit=3, restart_window_s=60, backoff_s=1, backoff_max_s=3), clock)
    drained.code, crashed.code = 0, 1
    for _ in range(5):
        sup.check()
        clock.now += 2
    assert drained.restarted == 0 and sup.stopped == {"decode-0"}
    assert crashed.restarted == 1
