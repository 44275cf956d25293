"""How the gateway sees unified workers, against a real redis-server: health is SERVING with a
unified worker alone (or a prefill and a decode worker), not with a decode worker alone; the
pool lists decode and unified workers together and names both roles when there is neither."""
from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from services.gateway.health import ReadinessMonitor
from services.gateway.routing import WorkerPool
from services.errors import Unavailable
from services.state.registry import WorkerInfo, WorkerRegistry


@pytest.fixture
async def registry(redis_url: str) -> AsyncIterator[WorkerRegistry]:
    client = aioredis.Redis.from_url(redis_url)
    yield WorkerRegistry(client, heartbeat_interval_s=10.0)
    await client.aclose()


async def register(registry: WorkerRegistry, worker_id: str, role: str) -> None:
    await registry.heartbeat(WorkerInfo(worker_id, role, f"127.0.0.1:{len(worker_id) + 5000}",
                                        free_kv_blocks=10, total_kv_blocks=10))


async def test_ready_with_a_unified_worker_alone_not_with_a_decode_worker_alone(registry):
    monitor = ReadinessMonitor(registry, health_servicer=None, service_names=[], heartbeat_s=10.0)
    assert (await monitor.check())[0] is False
    await register(registry, "decode-0", "decode")
    ready, why = await monitor.check()
    assert not ready and "prefill" in why
    await register(registry, "unified-0", "unified")
    assert await monitor.check() == (True, "")
    await registry.deregister("unified", "unified-0")
    await register(registry, "prefill-0", "prefill")
    assert await monitor.check() == (True, "")


async def test_pool_lists_decode_and_unified_workers_together(registry):
    pool = WorkerPool(registry, heartbeat_s=10.0, rpc_timeout_s=5.0)
    with pytest.raises(Unavailable, match="no live decode or unified worker"):
        await pool.live_any(("decode", "unified"))
    await register(registry, "unified-0", "unified")
    await register(registry, "decode-0", "decode")
    await register(registry, "prefill-0", "prefill")
    workers = await pool.live_any(("decode", "unified"))
    assert sorted((w.worker_id, w.role) for w in workers) == [("decode-0", "decode"),
                                                               ("unified-0", "unified")]
    pool.lost(workers[0], "test")  # skipped while suspect
    assert [w.worker_id for w in await pool.live_any(("decode", "unified"))] == [workers[1].worker_id]
    assert [w.worker_id for w in await pool.live("prefill")] == ["prefill-0"]
    await pool.close()


async def test_pool_keeps_a_listing_a_quarter_heartbeat_and_reads_an_empty_one_again(registry):
    """A role's listing is read from Redis once per quarter heartbeat, not per request; an empty
    one is read again at once, so a worker that registers is routed to without waiting."""
    pool = WorkerPool(registry, heartbeat_s=10.0, rpc_timeout_s=5.0)
    assert pool.listing_max_age_s == 2.5
    reads, listed = [], registry.list

    async def counted(role):
        reads.append(role)
        return await listed(role)

    registry.list = counted
    with pytest.raises(Unavailable):
        await pool.live("decode")
    await register(registry, "decode-0", "decode")
    assert [w.worker_id for w in await pool.live("decode")] == ["decode-0"]
    await register(registry, "decode-1", "decode")
    assert [w.worker_id for w in await pool.live("decode")] == ["decode-0"]  # kept
    assert reads == ["decode", "decode"]
    pool.listing_max_age_s = 0.0  # the listing has aged: read again
    assert sorted(w.worker_id for w in await pool.live("decode")) == ["decode-0", "decode-1"]
    assert reads == ["decode"] * 3
    await pool.close()


class _Runtime:  # what UnifiedServicer reads of a WorkerRuntime before any engine call
    worker_id = "unified-x"
    reservations = None
    GetLoad = None

    def release(self, request_id: str) -> None:
        raise AssertionError("nothing to release: the request was refused before the engine")


async def test_unified_worker_refuses_a_decode_without_local_prefill_naming_the_field():
    from services.api import worker_pb2
    from services.unified.server import UnifiedServicer

    servicer = UnifiedServicer(_Runtime())
    stream = servicer.Decode(worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=[1, 2]), None)
    with pytest.raises(ValueError, match=r"^local_prefill: unified worker unified-x"):
        await stream.__anext__()
    assert servicer.transport is None
    servicer.close()
