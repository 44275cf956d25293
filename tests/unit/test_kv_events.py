"""KV events (issue 26): the block manager records stored/removed by the prefix cache's own
chained hashes; the gateway computes the same hashes from token ids; a publisher carries them
over a real Redis stream to a reader, whose index then equals the worker's cache (snapshot
first, compaction, a restart's new epoch, a stream that expired)."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from services.engine.block_manager import BlockManager
from services.engine.kv_events import (REMOVED, STORED, KVEventLog, block_hash,
                                       prompt_block_hashes)
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.gateway.kv_index import EVENTS, PrefixIndex
from services.state import kv_events as stream
from services.state.kv_events import KVEventPublisher, KVEventReader, encode_events
from services.gateway.router import Router, RoutingOptions
from services.state.registry import ROLES, WorkerInfo, WorkerRegistry

BS = 4


def computed(bm: BlockManager, tokens: list[int], rid: str = "r") -> Request:
    r = Request(rid, list(tokens), SamplingParams(max_tokens=1))
    hits = bm.get_computed_blocks(r)
    assert bm.allocate_slots(r, r.num_tokens - len(hits) * BS, hits)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)
    return r


def test_block_manager_records_stored_and_removed_by_the_cache_keys():
    log = KVEventLog()
    bm = BlockManager(4, BS, log)
    a = computed(bm, [1] * 4 + [2] * 4 + [3])  # 3 blocks, 2 full
    h = prompt_block_hashes([1] * 4 + [2] * 4 + [3], BS)
    assert log.drain() == [(STORED, h[0]), (STORED, h[1])]
    assert sorted(bm.cached_hashes()) == sorted(h)
    bm.free(a)
    computed(bm, [7] * 4 + [8] * 4 + [9] * 4 + [0], "b")  # 4 blocks: evicts both cached ones
    events = log.drain()
    assert sorted(h for kind, h in events if kind == REMOVED) == sorted(h)
    assert [kind for kind, _ in events].count(STORED) == 3
    assert len(log) == 0


def test_the_gateways_hashes_are_the_caches_own():
    tokens = list(range(40))
    bm = BlockManager(16, BS)
    computed(bm, tokens)
    # all 10 full blocks are cached; a prompt of these 40 tokens can hit the first 9
    assert set(bm.cached_hashes()) == set(prompt_block_hashes(tokens + [0], BS))
    hits = bm.get_computed_blocks(Request("q", tokens, SamplingParams(max_tokens=1)))
    assert [bm.blocks[b].hash for b in hits] == prompt_block_hashes(tokens, BS)
    assert prompt_block_hashes(tokens, BS)[1] == block_hash(block_hash(0, (0, 1, 2, 3)),
                                                            (4, 5, 6, 7))
    assert len(prompt_block_hashes(tokens, BS)) == 9  # (40 - 1) // 4: the last token computes
    assert prompt_block_hashes(tokens, BS, max_blocks=3) == prompt_block_hashes(tokens, BS)[:3]
    with pytest.raises(ValueError, match="block_size"):
        prompt_block_hashes(tokens, 0)


def test_events_group_by_kind_in_order():
    assert encode_events([(STORED, 1), (STORED, 2), (REMOVED, 3), (STORED, 4)]) == [
        ["stored", [1, 2]], ["removed", [3]], ["stored", [4]]]


class _Cache:
    """A prefix cache stand-in: the set of hashes a publisher snapshots."""

    def __init__(self) -> None:
        self.log, self.hashes = KVEventLog(), set()
        self.num_copies = 0  # of the whole cache (snapshots)

    def store(self, *hs: int) -> None:
        for h in hs:
            self.hashes.add(h)
            self.log.stored(h)

    def remove(self, *hs: int) -> None:
        for h in hs:
            self.hashes.discard(h)
            self.log.removed(h)

    def publisher(self, client, worker_id="w", ttl_s=30.0) -> KVEventPublisher:
        return KVEventPublisher(client, worker_id, "m", BS, self.log, self.copy,
                                lambda: len(self.hashes), ttl_s)

    def copy(self) -> list[int]:
        self.num_copies += 1
        return list(self.hashes)


async def follow(reader: KVEventReader, index: PrefixIndex, workers=("w",)) -> list:
    batches = await reader.read(list(workers))
    for b in batches:
        index.apply(b.worker_id, b.epoch, b.seq, b.events)
    return batches


async def held(index: PrefixIndex, worker_id: str = "w") -> set[int]:
    w = index._workers.get(worker_id)
    return set(w.confirmed) if w else set()


async def test_a_reader_rebuilds_the_workers_cache_from_its_stream(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    try:
        cache = _Cache()
        cache.store(1, 2, 3)
        pub = cache.publisher(client)
        await pub.flush()  # the first entry: a snapshot
        cache.store(4)
        cache.remove(2)
        await pub.flush()
        reader, index = KVEventReader(client, block_ms=50), PrefixIndex()
        batches = await follow(reader, index)
        assert [b.seq for b in batches] == [0, 1] and batches[0].starts_snapshot
        assert (batches[0].model, batches[0].block_size) == ("m", BS)
        assert await held(index) == {1, 3, 4} == cache.hashes
        assert index.modes() == {"w": EVENTS}
        assert await follow(reader, index) == []  # nothing new: blocked 50 ms
        late = PrefixIndex()  # a gateway that starts now replays from the start
        await follow(KVEventReader(client, block_ms=50), late)
        assert await held(late) == cache.hashes
        await pub.stop(clear=True)  # drain / shutdown: "cleared"
        await follow(reader, index)
        assert await held(index) == set()
    finally:
        await client.aclose()


async def test_compaction_trims_the_stream_to_a_snapshot(redis_url, monkeypatch):
    monkeypatch.setattr(stream, "COMPACT_MIN_EVENTS", 3)
    client = aioredis.Redis.from_url(redis_url)
    try:
        cache = _Cache()
        pub = cache.publisher(client)
        snapshots, publish = [], pub._publish

        async def counted(events, snapshot):
            snapshots.extend([events] if snapshot else [])
            await publish(events, snapshot)

        pub._publish = counted
        await pub.flush()
        for h in range(10, 30):
            cache.store(h)
            cache.remove(h - 1) if h > 10 else None
            await pub.flush()
        entries = await client.xrange(stream.stream_key("w"))
        assert len(entries) < 10  # trimmed at each snapshot
        # the cache is copied for a snapshot only, not to test whether one is due (each flush)
        assert cache.num_copies == len(snapshots) >= 3
        late = PrefixIndex()
        await follow(KVEventReader(client, block_ms=50), late)
        assert await held(late) == cache.hashes == {29}
    finally:
        await client.aclose()


async def test_a_snapshot_goes_a_chunk_to_an_entry(redis_url, monkeypatch):
    """A snapshot of 7 hashes at 3 an entry: "cleared" and 3, then 3, then 1, in sequence, so
    no entry's encoding holds the GIL for the whole cache; a reader from the start, and one
    after a compaction (trimmed to the snapshot's first entry), holds the whole cache. The
    events after it count from its end."""
    monkeypatch.setattr(stream, "SNAPSHOT_CHUNK", 3)
    client = aioredis.Redis.from_url(redis_url)
    try:
        cache = _Cache()
        cache.store(*range(1, 8))
        pub = cache.publisher(client)
        await pub.flush()
        reader, index = KVEventReader(client, block_ms=50), PrefixIndex()
        batches = await follow(reader, index)
        assert [b.seq for b in batches] == [0, 1, 2] and batches[0].starts_snapshot
        assert [[len(e[1]) if len(e) > 1 else e[0] for e in b.events] for b in batches] == [
            ["cleared", 3], [3], [1]]
        assert await held(index) == cache.hashes and pub.num_published == 0
        cache.store(8)
        pub._snapshot_due = True  # as a compaction would
        await pub.flush()
        await follow(reader, index)
        late = PrefixIndex()
        await follow(KVEventReader(client, block_ms=50), late)
        assert await held(index) == await held(late) == cache.hashes == set(range(1, 9))
        assert len(await client.xrange(stream.stream_key("w"))) == 3  # 8 hashes: 3 + 3 + 2
    finally:
        await client.aclose()


async def test_a_restarted_worker_starts_empty_in_every_reader(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    try:
        cache = _Cache()
        cache.store(1, 2)
        pub = cache.publisher(client)
        await pub.flush()
        reader, index = KVEventReader(client, block_ms=50), PrefixIndex()
        await follow(reader, index)
        assert await held(index) == {1, 2}
        fresh = _Cache()  # same worker id, new process: a new epoch's snapshot, empty
        await fresh.publisher(client).flush()
        await follow(reader, index)
        assert await held(index) == set()
        assert len(await client.xrange(stream.stream_key("w"))) == 1  # the old epoch trimmed
    finally:
        await client.aclose()


async def test_the_stream_expires_with_its_worker_and_comes_back_as_a_snapshot(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    try:
        cache = _Cache()
        cache.store(1)
        pub = cache.publisher(client, ttl_s=0.2)
        await pub.flush()
        assert await client.exists(stream.stream_key("w"))
        await asyncio.sleep(0.4)  # a killed worker publishes no more: its stream goes
        assert not await client.exists(stream.stream_key("w"))
        cache.store(2)
        await pub.flush()  # recreated without history: the next entry is a snapshot
        cache.store(3)
        await pub.flush()
        index = PrefixIndex()
        await follow(KVEventReader(client, block_ms=50), index)
        assert await held(index) == {1, 2, 3}
    finally:
        await client.aclose()


async def test_a_bad_entry_is_skipped(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.xadd(stream.stream_key("w"), {"events": "not json"})
        cache = _Cache()
        cache.store(5)
        await cache.publisher(client).flush()
        index = PrefixIndex()
        batches = await follow(KVEventReader(client, block_ms=50), index)
        assert len(batches) == 1 and await held(index) == {5}
    finally:
        await client.aclose()


class _CancelLosingClient:
    """A Redis client whose transactions turn the CancelledError they get while waiting for the
    reply into a ConnectionError (redis-py can, while it closes the connection)."""

    def __init__(self) -> None:
        self.waiting = asyncio.Event()
        self.loses = True  # False: the cancellation goes through (the test's clean-up)

    def pipeline(self, transaction: bool = True):
        client = self

        class Pipe:
            async def __aenter__(self):
                return self

            async def __aexit__(self, *exc):
                return False

            def __getattr__(self, name):
                return lambda *args, **kwargs: None

            async def execute(self):
                client.waiting.set()
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    if not client.loses:
                        raise
                    raise redis.exceptions.ConnectionError("closed while cancelling") from None

        return Pipe()


async def test_publisher_stops_when_the_redis_client_loses_the_cancellation():
    """``stop(clear=False)`` returns although the cancellation never reaches the loop."""
    client = _CancelLosingClient()
    pub = _Cache().publisher(client)
    pub.start()
    loop_task = pub._task
    await client.waiting.wait()
    stopping = asyncio.ensure_future(pub.stop(clear=False))
    try:
        done, _ = await asyncio.wait({stopping}, timeout=5)
        assert done, "stop() did not return: the publishing loop outlived its cancellation"
        assert pub._task is None
    finally:  # a failed run must not leave the loop publishing past the test
        client.loses = False
        loop_task.cancel()
        await asyncio.wait({loop_task, stopping}, timeout=5)


async def test_the_gateways_follower_lets_the_event_loop_run_between_batches(redis_url,
                                                                         monkeypatch):
    """A snapshot read in one XREAD (5 entries of 2 hashes) is parsed and applied a batch at a
    time with the event loop's other tasks (the token relay) running between them, not in one
    go."""
    monkeypatch.setattr(stream, "SNAPSHOT_CHUNK", 2)
    client = aioredis.Redis.from_url(redis_url)
    registry = WorkerRegistry(client, heartbeat_interval_s=1.0)
    router = Router(RoutingOptions(mode="kv", kv_events=True), registry, "m")
    cache = _Cache()
    cache.store(*range(1, 11))
    pub = cache.publisher(client)
    trail, apply = [], router._apply

    def applied(batch, worker):
        trail.append(f"apply {batch.seq}")
        apply(batch, worker)

    async def other_task():
        while True:
            trail.append("tick")
            await asyncio.sleep(0)

    def parsed(worker_id, entry_id, raw):
        trail.append("parse")
        return parse(worker_id, entry_id, raw)

    router._apply, parse = applied, stream._parse
    monkeypatch.setattr(stream, "_parse", parsed)
    ticker = asyncio.ensure_future(other_task())
    try:
        await registry.heartbeat(WorkerInfo("w", "unified", "127.0.0.1:1", block_size=BS,
                                            total_kv_blocks=64))
        await pub.flush()  # the snapshot: 5 entries, in the stream before the follower reads
        router.start()
        for _ in range(100):
            if await held(router.index) == cache.hashes:
                break
            await asyncio.sleep(0.02)
        assert await held(router.index) == cache.hashes
        for step in ("parse", "apply"):
            at = [i for i, t in enumerate(trail) if t.startswith(step)]
            assert len(at) == 5
            assert all("tick" in trail[a:b] for a, b in zip(at, at[1:])), (step, trail)
    finally:
        ticker.cancel()
        await router.stop()
        await pub.stop(clear=False)
        await client.aclose()


async def test_the_gateways_follower_lists_the_registry_once_a_heartbeat_not_per_read(redis_url):
    """Events flushed every 20 ms wake the follower's read each time; the registry (a set and a
    hash per worker and role) is listed again only once a heartbeat interval, yet every batch
    reaches the index."""
    client = aioredis.Redis.from_url(redis_url)
    registry = WorkerRegistry(client, heartbeat_interval_s=1.0)
    listings = []
    listed = registry.list

    async def counted(role):
        listings.append(role)
        return await listed(role)

    registry.list = counted
    router = Router(RoutingOptions(mode="kv", kv_events=True), registry, "m")
    cache = _Cache()
    pub = cache.publisher(client)
    try:
        await registry.heartbeat(WorkerInfo("w", "unified", "127.0.0.1:1", block_size=BS,
                                            total_kv_blocks=64))
        await pub.flush()  # the snapshot
        router.start()
        loop = asyncio.get_running_loop()
        start = loop.time()
        for h in range(100, 160):  # 60 batches, 20 ms apart: 1.2 s
            cache.store(h)
            await pub.flush()
            await asyncio.sleep(0.02)
        for _ in range(100):  # the last batches land
            if await held(router.index) == cache.hashes:
                break
            await asyncio.sleep(0.02)
        elapsed = loop.time() - start
        assert await held(router.index) == cache.hashes  # all 61 batches applied
        assert router.num_events >= 30  # reads woke far more often than once a heartbeat
        # one listing (all roles) at the start and one a heartbeat after: not one per read
        assert len(listings) <= len(ROLES) * (int(elapsed / 1.0) + 2), (listings, elapsed)
    finally:
        await router.stop()
        await pub.stop(clear=False)
        await client.aclose()
