"""The gateway's global prefix index: which worker holds which prefix-cache blocks, by the
chained block hashes the workers' caches use (``services/engine/kv_events.py``).

Per worker, two kinds of entries:
- *confirmed*: from the worker's KV events (``apply``): exactly what its cache held when it
  published them (Dynamo's ``KvIndexer``, vLLM's KV events);
- *predicted*: from this gateway's own routing (``predict``): the prompt's blocks will be in
  the chosen worker's cache once it has computed (or received) them. They expire after a TTL
  (Dynamo's approximate indexer: 120 s without events). With events, a prediction only bridges
  the time until the worker's own "stored" event arrives, so it lives ``EVENTS_PREDICTION_TTL_S``.

A worker is in *events* mode once its stream's snapshot has been applied, else *approximate*
(events off, not yet read, or lost: a gap in its stream's sequence drops its confirmed entries
until the next snapshot). ``match`` finds, for every worker, the longest prefix of a prompt's
hashes it holds (confirmed or live prediction), in O(prompt blocks x workers holding them).

Memory is bounded: a worker's entries are capped at its KV block count (``capacity``; a cache
cannot hold more), the oldest predictions dropped first, and every entry of a worker goes when
it leaves (``drop``: registry expiry, drain, restart). ``size`` is the number of entries.
Single-threaded (the gateway's event loop).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

APPROXIMATE_PREDICTION_TTL_S = 120.0  # Dynamo's default router TTL without KV events
EVENTS_PREDICTION_TTL_S = 30.0  # with events: until the worker's own stored events arrive
DEFAULT_CAPACITY = 1 << 20  # entries of a worker whose KV block count is unknown

EVENTS, APPROXIMATE = "events", "approximate"


class _Worker:
    __slots__ = ("confirmed", "predicted", "capacity", "mode", "epoch", "seq")

    def __init__(self, capacity: int) -> None:
        self.confirmed: set[int] = set()
        self.predicted: OrderedDict[int, float] = OrderedDict()  # hash -> expiry, oldest first
        self.capacity = capacity
        self.mode = APPROXIMATE
        self.epoch, self.seq = "", -1  # of the last event batch applied


class PrefixIndex:
    """Block hashes per worker. ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(self, clock=time.monotonic) -> None:
        self._workers: dict[str, _Worker] = {}
        self._holders: dict[int, set[str]] = {}  # hash -> workers holding it (either kind)
        self._clock = clock

    # -- reading -------------------------------------------------------------------------------
    def match(self, hashes: list[int], workers: Iterable[str] | None = None) -> dict[str, int]:
        """Blocks of the longest prefix of ``hashes`` each worker holds (only workers with at
        least one; only those in ``workers`` when given)."""
        self._expire()
        allowed = None if workers is None else set(workers)
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, h in enumerate(hashes, 1):
            holders = self._holders.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if allowed is not None:
                alive &= allowed
            if not alive:
                break
            for w in alive:
                out[w] = depth
        return out

    @property
    def size(self) -> int:
        """Entries (confirmed and predicted) over all workers."""
        return sum(len(w.confirmed) + len(w.predicted) for w in self._workers.values())

    def modes(self) -> dict[str, str]:
        """worker id -> ``EVENTS`` or ``APPROXIMATE``."""
        return {wid: w.mode for wid, w in self._workers.items()}

    def worker_ids(self) -> list[str]:
        return list(self._workers)

    # -- writing -------------------------------------------------------------------------------
    def apply(self, worker_id: str, epoch: str, seq: int, events: list, capacity: int = 0) -> bool:
        """Apply one batch of ``worker_id``'s KV events (``services/state/kv_events.py``:
        ``["cleared"]``, ``["stored", hashes]``, ``["removed", hashes]``). A batch that starts
        with "cleared" (a snapshot) puts the worker in events mode; one that does not follow
        the last applied batch of the same epoch in sequence (a gap, or a new epoch without
        its snapshot) drops the worker's confirmed entries and leaves it approximate until the
        next snapshot. Returns False when it found such a gap."""
        w = self._worker(worker_id, capacity)
        snapshot = bool(events) and events[0][0] == "cleared"
        in_order = epoch == w.epoch and seq == w.seq + 1
        w.epoch, w.seq = epoch, seq
        if not snapshot and not in_order:
            self._clear_confirmed(worker_id, w)
            w.mode = APPROXIMATE
            return False
        if not snapshot and w.mode != EVENTS:
            return True  # entries after a gap: useless without the snapshot that follows
        for event in events:
            kind = event[0]
            if kind == "cleared":
                self._clear_confirmed(worker_id, w)
                self._clear_predicted(worker_id, w)
                w.mode = EVENTS
            elif kind == "stored":
                for h in event[1]:
                    self._store(worker_id, w, int(h))
            elif kind == "removed":
                for h in event[1]:
                    self._remove(worker_id, w, int(h))
        return True

    def predict(self, worker_id: str, hashes: list[int], capacity: int = 0) -> None:
        """``worker_id`` was chosen for a prompt of these block ``hashes``: expect them in its
        cache for the prediction TTL of its mode (refreshed if already predicted)."""
        w = self._worker(worker_id, capacity)
        expiry = self._clock() + (EVENTS_PREDICTION_TTL_S if w.mode == EVENTS
                                  else APPROXIMATE_PREDICTION_TTL_S)
        for h in hashes:
            if h in w.confirmed:
                continue
            w.predicted[h] = expiry
            w.predicted.move_to_end(h)
            self._holders.setdefault(h, set()).add(worker_id)
        self._bound(worker_id, w)

    def drop(self, worker_id: str) -> None:
        """Forget every entry of ``worker_id`` (it left the registry, drained or restarted)."""
        w = self._workers.pop(worker_id, None)
        if w is not None:
            for h in list(w.confirmed) + list(w.predicted):
                self._unhold(h, worker_id)

    def keep_only(self, worker_ids: Iterable[str]) -> list[str]:
        """``drop`` every worker not in ``worker_ids``; returns those dropped."""
        keep = set(worker_ids)
        gone = [w for w in self._workers if w not in keep]
        for w in gone:
            self.drop(w)
        return gone

    # -- internals -----------------------------------------------------------------------------
    def _worker(self, worker_id: str, capacity: int) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _Worker(capacity or DEFAULT_CAPACITY)
        elif capacity:
            w.capacity = capacity
        return w

    def _store(self, worker_id: str, w: _Worker, h: int) -> None:
        w.predicted.pop(h, None)  # confirmed now
        w.confirmed.add(h)
        self._holders.setdefault(h, set()).add(worker_id)
        self._bound(worker_id, w)

    def _remove(self, worker_id: str, w: _Worker, h: int) -> None:
        w.confirmed.discard(h)
        w.predicted.pop(h, None)  # evicted: a prediction of it is stale too
        self._unhold(h, worker_id)

    def _bound(self, worker_id: str, w: _Worker) -> None:
        """At most ``capacity`` entries: the oldest predictions go first, then (a worker that
        publishes more than its cache holds: a bug) arbitrary confirmed ones."""
        while len(w.confirmed) + len(w.predicted) > w.capacity and w.predicted:
            h, _ = w.predicted.popitem(last=False)
            self._unhold(h, worker_id, w)
        while len(w.confirmed) > w.capacity:
            self._unhold(w.confirmed.pop(), worker_id, w)

    def _expire(self) -> None:
        now = self._clock()
        for worker_id, w in self._workers.items():
            while w.predicted:
                h, expiry = next(iter(w.predicted.items()))
                if expiry > now:
                    break
                del w.predicted[h]
                self._unhold(h, worker_id, w)

    def _clear_confirmed(self, worker_id: str, w: _Worker) -> None:
        old, w.confirmed = w.confirmed, set()
        for h in old:
            self._unhold(h, worker_id, w)

    def _clear_predicted(self, worker_id: str, w: _Worker) -> None:
        old, w.predicted = w.predicted, OrderedDict()
        for h in old:
            self._unhold(h, worker_id, w)

    def _unhold(self, h: int, worker_id: str, w: _Worker | None = None) -> None:
        """``worker_id`` no longer holds ``h`` unless still in its other kind of entry."""
        if w is not None and (h in w.confirmed or h in w.predicted):
            return
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[h]
