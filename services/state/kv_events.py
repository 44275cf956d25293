"""KV events over Redis Streams: each worker publishes what its prefix cache stores and evicts to
``kv_events:{worker_id}``; every gateway reads every live worker's stream into its prefix index.

Why Redis Streams (docs/architecture.md, "KV events", has the measured figures): the Redis every
gateway already shares is the only new dependency; a stream keeps its entries, so a gateway that
starts late or reconnects replays from a known id (``XREAD`` from its last id, or from the start)
instead of asking each worker; one ``XREAD`` follows every worker, and any number of gateways
read the same entries, so they route alike. A worker-side gRPC stream would need a connection
per (gateway, worker) pair and a replay protocol of its own.

Entry fields (one entry per batch, flushed every ``flush_s`` off the engine thread):

- ``model``, ``block_size``, ``hash``: the stream's header, in every entry (a few bytes): the
  served model, tokens per block and how block hashes are computed (``HASH_SCHEME``);
- ``epoch``: random per publisher start (a restarted worker keeps its id, not its epoch);
- ``seq``: 0, 1, 2, ... within the epoch (a gap means entries were lost);
- ``t``: the publisher's wall clock when it drained the batch (event lag at the reader);
- ``events``: JSON, a list of ``["cleared"]``, ``["stored", [hash, ...]]``,
  ``["removed", [hash, ...]]`` in the order they happened.

A publisher's first entry, and every entry after a failed publish or a compaction, begins with
``["cleared"]`` followed by every hash its cache holds (a *snapshot*), so a reader that starts
there has the whole cache. A snapshot's hashes go ``SNAPSHOT_CHUNK`` to an entry: the first
entry holds ``["cleared"]`` and the first chunk, the entries right after it the rest, each a
plain ``["stored", ...]``, and the event loop runs between them (one entry of a 100k-block
cache, a GPU worker's, took 13-54 ms of ``json.dumps`` with the GIL held on a 2-core Xeon VM:
a stall of the engine thread's steps; 4,096 hashes take 0.3-0.4 ms). Compaction: once the
hashes published since the last snapshot exceed twice the cache plus ``COMPACT_MIN_EVENTS``,
the publisher writes a snapshot and trims the stream to start at it (``XTRIM MINID``), so a
stream holds O(cache size) hashes and every reader sees either all entries or a snapshot
first. Drain and shutdown publish ``["cleared"]``. The stream expires ``ttl_s`` after the
publisher's last write (refreshed while it lives), as the registry's entry does: a killed
worker's stream goes away with it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from services.engine.kv_events import HASH_SCHEME, REMOVED, STORED, KVEventLog

log = logging.getLogger(__name__)

CLEARED = "cleared"
FLUSH_S = 0.02  # how often a publisher drains its log (the floor of the event lag)
COMPACT_MIN_EVENTS = 4096  # hashes published since the last snapshot before compaction is due
SNAPSHOT_CHUNK = 4096  # hashes per entry of a snapshot (~0.3 ms of json.dumps each)
READ_COUNT = 1024  # entries one XREAD returns per stream at most


def stream_key(worker_id: str) -> str:
    return f"kv_events:{worker_id}"


def encode_events(events: list[tuple[str, int]]) -> list[list]:
    """Group consecutive events of one kind: [(STORED, a), (STORED, b), (REMOVED, c)] ->
    [["stored", [a, b]], ["removed", [c]]]."""
    out: list[list] = []
    for kind, h in events:
        if out and out[-1][0] == kind:
            out[-1][1].append(h)
        else:
            out.append([kind, [h]])
    return out


@dataclass(frozen=True)
class KVEventBatch:
    """One stream entry as a reader sees it (module docstring: the fields)."""

    worker_id: str
    entry_id: str
    model: str
    block_size: int
    hash_scheme: str
    epoch: str
    seq: int
    time_s: float
    events: list  # [["cleared"] | ["stored", [int, ...]] | ["removed", [int, ...]], ...]

    @property
    def starts_snapshot(self) -> bool:
        return bool(self.events) and self.events[0][0] == CLEARED


class KVEventPublisher:
    """Publishes one worker's ``KVEventLog`` to its stream, on the worker's event loop.

    ``cached_hashes()`` returns every hash the cache holds now (``BlockManager.cached_hashes``,
    safe from this thread) and ``num_cached()`` how many there are (``num_cached_blocks``:
    the compaction test reads it every flush, where a copy of a GPU's 100k-block cache would
    hold the GIL from the engine thread 50 times a second); a snapshot is taken after
    draining the log, so events recorded meanwhile are both in the snapshot and in the next
    batch, which a reader applies idempotently (stored adds, removed discards, in order). A
    Redis error is logged once per outage; what was drained meanwhile is replaced by a
    snapshot when publishing works again.
    """

    def __init__(self, client: aioredis.Redis, worker_id: str, model: str, block_size: int,
                 events: KVEventLog, cached_hashes: Callable[[], list[int]],
                 num_cached: Callable[[], int], ttl_s: float, flush_s: float = FLUSH_S) -> None:
        self.client, self.key = client, stream_key(worker_id)
        self.header = {"model": model, "block_size": str(block_size), "hash": HASH_SCHEME,
                       "epoch": secrets.token_hex(8)}
        self.events, self.cached_hashes, self.num_cached = events, cached_hashes, num_cached
        self.ttl_ms, self.flush_s = max(1, int(ttl_s * 1000)), flush_s
        self.seq = 0
        self.num_published = 0  # hashes in entries written since the last snapshot
        self.num_events = 0  # events published in all (a worker metric)
        self._snapshot_due = True  # the first entry is a snapshot
        self._refreshed_at = 0.0  # monotonic time of the last write (it refreshes the TTL)
        self._failing = False
        self._task: asyncio.Task | None = None
        self._stopping = False  # stop() called: the loop ends after the flush in progress

    def start(self) -> None:
        """Publish a snapshot at once, then a batch every ``flush_s`` while there are events."""
        self._stopping = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-events")

    async def stop(self, clear: bool = True) -> None:
        """Stop publishing; with ``clear``, publish ``["cleared"]`` last (drain, shutdown). The
        loop ends by a flag as well as by the cancellation, which a Redis error raised while the
        client closes its connection can replace (``Heartbeater.stop``)."""
        if self._task is not None:
            self._stopping = True
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if clear:
            self.events.drain()
            await self._publish([[CLEARED]], snapshot=True)

    async def _run(self) -> None:
        while not self._stopping:
            await self.flush()
            if not self._stopping:
                await asyncio.sleep(self.flush_s)

    async def flush(self) -> None:
        """Publish what the log holds (or a snapshot when one is due); refresh the stream's TTL
        when nothing was written for a third of it."""
        drained = self.events.drain()
        if self._snapshot_due or (self.num_published > COMPACT_MIN_EVENTS and self.num_published
                                  > 2 * self.num_cached() + COMPACT_MIN_EVENTS):
            await self._publish_snapshot(self.cached_hashes())
        elif drained:
            await self._publish(encode_events(drained), snapshot=False)
        elif time.monotonic() - self._refreshed_at > self.ttl_ms / 3000:
            await self._refresh()

    async def _publish_snapshot(self, hashes: list[int]) -> None:
        """``["cleared"]`` and ``hashes``, ``SNAPSHOT_CHUNK`` to an entry (the module
        docstring): the first entry starts the snapshot (compaction trims the stream to it),
        the rest follow it before any other entry of this publisher. A failed entry leaves a
        snapshot due, so the next flush starts one again."""
        await self._publish([[CLEARED], [STORED, hashes[:SNAPSHOT_CHUNK]]], snapshot=True)
        for i in range(SNAPSHOT_CHUNK, len(hashes), SNAPSHOT_CHUNK):
            if self._snapshot_due:  # an entry failed
                return
            await self._publish([[STORED, hashes[i:i + SNAPSHOT_CHUNK]]], snapshot=False)
        self.num_published = 0  # counted from the end of the snapshot

    async def _publish(self, events: list[list], snapshot: bool) -> None:
        fields = {**self.header, "seq": str(self.seq), "t": repr(time.time()),
                  "events": json.dumps(events, separators=(",", ":"))}
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.exists(self.key)
                pipe.xadd(self.key, fields)
                pipe.pexpire(self.key, self.ttl_ms)
                existed, entry_id, _ = await pipe.execute()
                if snapshot:
                    await self.client.xtrim(self.key, minid=entry_id, approximate=False)
        except (redis.RedisError, OSError) as exc:
            if not self._failing:
                log.warning("publishing KV events to Redis failed (%s); a snapshot follows "
                            "once it works again", exc)
            self._failing, self._snapshot_due = True, True
            return
        if self._failing:
            log.info("publishing KV events to Redis works again")
        self._failing = False
        self.seq += 1
        self._refreshed_at = time.monotonic()
        hashes = sum(len(e[1]) for e in events if len(e) > 1)
        self.num_events += hashes + sum(1 for e in events if e[0] == CLEARED)
        self.num_published = 0 if snapshot else self.num_published + hashes
        # the stream had expired (or Redis lost it): readers starting now lack the past
        self._snapshot_due = not existed and not snapshot

    async def _refresh(self) -> None:
        try:
            if not await self.client.pexpire(self.key, self.ttl_ms):
                self._snapshot_due = True  # the stream is gone: start it again with a snapshot
            self._refreshed_at = time.monotonic()
        except (redis.RedisError, OSError):
            self._snapshot_due = True


class KVEventReader:
    """Reads the streams of a changing set of workers, each from where it left off.

    ``read(worker_ids)`` blocks up to ``block_ms`` for new entries of any of them; a worker seen
    for the first time is read from the start of its stream (its last snapshot, or its first
    entry); one no longer listed is forgotten. Entries that do not parse are logged and
    skipped. Raises redis.RedisError / OSError when Redis is unreachable."""

    def __init__(self, client: aioredis.Redis, block_ms: int = 500) -> None:
        self.client, self.block_ms = client, block_ms
        self._last: dict[str, str] = {}  # worker id -> id of the last entry read

    async def read(self, worker_ids: list[str]) -> list[KVEventBatch]:
        self._last = {w: self._last.get(w, "0") for w in worker_ids}
        if not self._last:
            await asyncio.sleep(self.block_ms / 1000)
            return []
        reply = await self.client.xread({stream_key(w): i for w, i in self._last.items()},
                                        count=READ_COUNT, block=self.block_ms)
        out = []
        for key, entries in reply or ():
            worker_id = _text(key).removeprefix("kv_events:")
            for entry_id, fields in entries:
                entry_id = _text(entry_id)
                if worker_id in self._last:
                    self._last[worker_id] = entry_id
                try:
                    out.append(_parse(worker_id, entry_id, fields))
                except (KeyError, ValueError, TypeError) as exc:
                    log.warning("skipping KV event entry %s of worker %s: %s", entry_id,
                                worker_id, exc)
                await asyncio.sleep(0)  # parse an entry at a time (a snapshot is many)
        return out


def _parse(worker_id: str, entry_id: str, raw: dict) -> KVEventBatch:
    fields = {_text(k): _text(v) for k, v in raw.items()}
    events = json.loads(fields["events"])
    if not isinstance(events, list) or not all(
            isinstance(e, list) and e and e[0] in (CLEARED, STORED, REMOVED) for e in events):
        raise ValueError("events: not a list of [kind, hashes] entries")
    return KVEventBatch(worker_id, entry_id, fields["model"], int(fields["block_size"]),
                        fields.get("hash", ""), fields["epoch"], int(fields["seq"]),
                        float(fields["t"]), events)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
