"""Where a request goes: ranks the live workers for it by ``gateway.routing`` (random, load, kv),
decides conditional disaggregation, and keeps the prefix index that kv routing reads fed.

- ``random``: workers in random order (the first with room serves).
- ``load``: by load alone (``scoring.cost`` with weight 0).
- ``kv``: by cost (``scoring.py``) over the global prefix index (``kv_index.py``), which a
  background task fills from every live worker's KV event stream (``services/state/
  kv_events.py``), and which learns from this gateway's own decisions where events are off or
  not read yet (approximate mode).

Disaggregated stacks choose a pair: the decode worker by its cache and load (the blocks it
holds are pinned, not transferred), the prefill worker by its own cache and load; and whether
the decode worker prefills the prompt itself (``scoring.local_prefill_reason``, with the KV
handoff's cost that this gateway measures per pair: ``observe_handoff``, and forgets over
``HANDOFF_HALF_LIFE_S``). Load comes
from the registry's heartbeats, plus the requests this gateway sent a worker since its last
heartbeat (so a burst does not all land on the worker that looked idle a second ago).
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from services.engine.kv_events import HASH_SCHEME, prompt_block_hashes
from services.engine.step_cost import StepCostModel
from services.gateway import scoring
from services.gateway.kv_index import EVENTS, PrefixIndex
from services.state.kv_events import KVEventReader
from services.state.registry import ROLES, WorkerInfo, WorkerRegistry

log = logging.getLogger(__name__)

MODES = ("random", "load", "kv")
STOP_TIMEOUT_S = 2.0  # longest wait for the KV event follower to end (``Router.stop``)
# A measured KV handoff counts half as much after this many seconds (``Router.observe_handoff``)
HANDOFF_HALF_LIFE_S = 30.0


@dataclass(frozen=True)
class RoutingOptions:
    """``gateway.routing`` and its knobs (services/config/settings.py describes each)."""

    mode: str = "kv"
    weight: float = 1.0  # kv_overlap_score_weight
    temperature: float = 0.0
    kv_events: bool = True
    pd_threshold_tokens: int = 256

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"routing: {self.mode!r} is not one of {MODES}")
        if self.weight < 0 or self.temperature < 0 or self.pd_threshold_tokens < 0:
            raise ValueError("kv_overlap_score_weight, router_temperature and "
                             "pd_threshold_tokens must be >= 0")


@dataclass
class Route:
    """One ranked choice for a request: a worker, and how and why."""

    worker: WorkerInfo
    reason: str
    overlap_blocks: int = 0
    cost: float = 0.0
    local_prefill: bool = False  # a decode worker computes the prompt itself

    @property
    def attributes(self) -> dict:
        return {"tandem.routing.reason": self.reason,
                "tandem.routing.overlap_blocks": self.overlap_blocks,
                "tandem.routing.cost": self.cost,
                "tandem.routing.local_prefill": self.local_prefill}


@dataclass
class Ticket:
    """One request this gateway sent a worker, for the load the worker's heartbeats do not show
    yet (sent after the last one) or show still (done after it). Times are unix seconds,
    compared with the worker's ``last_heartbeat`` (one clock per host; skew between hosts
    shifts which heartbeat counts a request, not the sum for long). ``prefilled`` at its first
    token, ``ended`` when the worker no longer holds it."""

    at: float
    tokens: int  # prompt tokens the worker computes for it (0: it receives the KV)
    prefilled_at: float | None = None
    ended_at: float | None = None

    def prefilled(self) -> None:
        if self.prefilled_at is None:
            self.prefilled_at = time.time()

    def ended(self) -> None:
        self.prefilled()
        if self.ended_at is None:
            self.ended_at = time.time()


@dataclass
class Router:
    """Ranks workers for each request; ``start``/``stop`` the KV event follower (kv routing
    with ``kv_events``). ``model``: the served model name (streams of other models are
    ignored). ``metrics``: the gateway's ``GatewayMetrics`` (or None)."""

    options: RoutingOptions
    registry: WorkerRegistry
    model: str
    metrics: object = None
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.monotonic  # seconds, for the handoffs' forgetting

    def __post_init__(self) -> None:
        self.index = PrefixIndex()
        self._sent: dict[str, list[Ticket]] = {}
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._ignored: set[str] = set()  # workers whose streams name another model or hash
        self._suspects: dict[str, float] = {}  # worker id -> monotonic time it is trusted again
        # (prefill worker, decode worker) -> (handoff seconds against blocks handed over,
        # clock at the last handoff)
        self._handoffs: dict[tuple[str, str], tuple[StepCostModel, float]] = {}
        self.num_events = 0  # event batches applied

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        o = self.options
        follows = o.mode == "kv" and o.kv_events
        log.info("routing %s (kv_overlap_score_weight %g, router_temperature %g, "
                 "pd_threshold_tokens %d); prefix index: %s", o.mode, o.weight, o.temperature,
                 o.pd_threshold_tokens,
                 "KV events from Redis streams kv_events:* (approximate for a worker until its "
                 "stream is read)" if follows else
                 "approximate (learned from this gateway's routing)" if o.mode == "kv" else "none")
        if follows:
            self._task = asyncio.get_running_loop().create_task(self._follow(), name="kv-index")

    async def stop(self) -> None:
        """Stop following. Bounded: a cancellation that lands in redis-py's socket timeout can
        come out as ``redis.TimeoutError`` (Python 3.11's ``asyncio.timeout``), which the
        follower would take for an outage and retry; it also ends on ``_stopping``."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=STOP_TIMEOUT_S)
            self._task = None

    # -- ranking -------------------------------------------------------------------------------
    def rank_decode(self, prompt: list[int], decode: list[WorkerInfo],
                    prefill: list[WorkerInfo]) -> list[Route]:
        """Decode and unified workers for ``prompt``, best first; a decode worker's route says
        whether it should prefill the prompt itself (conditional disaggregation, judged
        against the best of ``prefill``; always when there is no prefill worker)."""
        routes = self._rank(prompt, decode)
        if not routes or all(r.worker.role == "unified" for r in routes):
            return routes
        best_prefill = self._rank(prompt, prefill)[:1] if self.options.mode != "random" else []
        p = self._candidate(best_prefill[0].worker, best_prefill[0].overlap_blocks) \
            if best_prefill else None
        for r in routes:
            if r.worker.role != "decode":
                continue
            if not prefill:
                r.local_prefill = True  # nothing else can compute it
                continue
            if self.options.mode == "random":
                continue
            d = self._candidate(r.worker, r.overlap_blocks)
            handoff = self._handoff_seconds(p, d, len(prompt)) if p is not None else 0.0
            why = scoring.local_prefill_reason(len(prompt), d, p, self.options.pd_threshold_tokens,
                                               handoff)
            if why is not None:
                r.local_prefill, r.reason = True, why
        return routes

    def observe_handoff(self, prefill_id: str, decode_id: str, num_blocks: int,
                        seconds: float) -> None:
        """A Prefill call of worker ``prefill_id`` into a reservation of ``decode_id`` took
        ``seconds`` beyond the prefill worker's queue and compute, handing over ``num_blocks``
        KV blocks: the transfer, its acknowledgement and the call's round trip, which the
        remote path costs a prompt and the local one does not. Fitted per pair
        (``StepCostModel``: base + per block), each earlier handoff counting half as much
        every ``HANDOFF_HALF_LIFE_S`` seconds, and counted (``kv_handoff_seconds``)."""
        seconds, now = max(seconds, 0.0), self.clock()
        model, at = self._handoffs.get((prefill_id, decode_id), (StepCostModel(), now))
        model.observe(num_blocks, seconds, forget=_halved(now - at))
        self._handoffs[(prefill_id, decode_id)] = (model, now)
        if self.metrics is not None:
            self.metrics.kv_handoff_seconds.observe(seconds)

    def _handoff_seconds(self, prefill: scoring.Candidate, decode: scoring.Candidate,
                         num_prompt_tokens: int) -> float:
        """The expected handoff of the blocks ``decode`` lacks of the prompt, from ``prefill``:
        the pair's fit, times the weight its handoffs still have when that is under one
        handoff's. So what is known fades back to what is assumed without knowledge, a free
        handoff, and a pair whose slow handoff (a first connection, a stall) kept prompts on
        the decode worker, where no new handoff is measured, is tried again within a few
        half-lives (0.0 before this gateway has seen one between them)."""
        known = self._handoffs.get((prefill.worker_id, decode.worker_id))
        if known is None:
            return 0.0
        model, at = known
        uncached = decode.uncached_tokens(num_prompt_tokens)
        weight = min(1.0, model.weight * _halved(self.clock() - at))
        return weight * model.expected_seconds(-(-uncached // decode.block_size))

    def rank_prefill(self, prompt: list[int], prefill: list[WorkerInfo]) -> list[Route]:
        """Prefill workers for ``prompt``, best first (by their own caches and load)."""
        return self._rank(prompt, prefill)

    def _rank(self, prompt: list[int], workers: list[WorkerInfo]) -> list[Route]:
        o = self.options
        if not workers:
            return []
        if o.mode == "random":
            order = list(workers)
            self.rng.shuffle(order)
            return [Route(w, scoring.RANDOM) for w in order]
        overlaps = self._overlaps(prompt, workers) if o.mode == "kv" and o.weight > 0 else {}
        by_id = {w.worker_id: w for w in workers}
        candidates = [self._candidate(w, overlaps.get(w.worker_id, 0)) for w in workers]
        weight = o.weight if o.mode == "kv" else 0.0
        routes = []
        for s in scoring.rank(candidates, _prompt_blocks(prompt, workers), weight,
                              o.temperature, self.rng):
            c = s.candidate
            routes.append(Route(by_id[c.worker_id], scoring.reason(c, candidates, weight),
                                c.overlap_blocks, s.cost))
        return routes

    def _overlaps(self, prompt: list[int], workers: list[WorkerInfo]) -> dict[str, int]:
        """Cached prefix blocks of ``prompt`` per worker, hashed once per block size."""
        out: dict[str, int] = {}
        by_size: dict[int, list[str]] = {}
        for w in workers:
            if w.block_size > 0:
                by_size.setdefault(w.block_size, []).append(w.worker_id)
        for block_size, ids in by_size.items():
            out.update(self.index.match(prompt_block_hashes(prompt, block_size), ids))
        return out

    def _candidate(self, w: WorkerInfo, overlap_blocks: int) -> scoring.Candidate:
        """The scorer's view of ``w``: its last heartbeat, plus what this gateway sent it since,
        minus what this gateway's requests it counted have finished since (Dynamo's routers
        track their own requests' prefill and decode the same way)."""
        beat = w.last_heartbeat
        tickets = [t for t in self._sent.get(w.worker_id, ())
                   if t.ended_at is None or t.ended_at > beat]  # else: done and reflected
        self._sent[w.worker_id] = tickets
        queued, running = w.num_prefill_tokens, w.num_running
        for t in tickets:
            if t.at > beat:  # not in the heartbeat yet
                queued += t.tokens if t.prefilled_at is None else 0
                running += t.ended_at is None
            else:  # in it, perhaps done since
                queued -= t.tokens if t.prefilled_at is not None and t.prefilled_at > beat else 0
                running -= t.ended_at is not None
        return scoring.Candidate(w.worker_id, overlap_blocks, max(queued, 0), max(running, 0),
                                 w.free_kv_blocks, w.block_size or 16, w.prefill_seconds_per_token)

    # -- what was decided ----------------------------------------------------------------------
    def routed(self, route: Route, prompt: list[int], computes: bool, sent_at: float) -> Ticket:
        """``route`` serves ``prompt`` (counted by reason); the worker will hold its blocks
        (a prediction in the index) and, with ``computes``, compute the part it lacks.
        ``sent_at``: unix time the request was sent (a heartbeat after it may count it, even
        though the worker's answer, and this call, came later). The caller marks the returned
        ticket ``prefilled`` and ``ended``."""
        if self.metrics is not None:
            self.metrics.routing_decisions[route.reason].inc()
        w = route.worker
        log.debug("routed to %s worker %s (%s): %d of %d prompt tokens cached there, cost %.1f%s",
                  w.role, w.worker_id, route.reason, route.overlap_blocks * (w.block_size or 16),
                  len(prompt), route.cost, ", prefilled there" if route.local_prefill else "")
        tokens = len(prompt) - route.overlap_blocks * (w.block_size or 16) if computes else 0
        ticket = Ticket(sent_at, max(tokens, 0))
        self._sent.setdefault(w.worker_id, []).append(ticket)
        if self.options.mode == "kv" and w.block_size > 0:
            self.index.predict(w.worker_id, prompt_block_hashes(prompt, w.block_size),
                               w.total_kv_blocks)
            self._publish_gauges()
        return ticket

    def lost(self, worker_id: str, suspect_s: float) -> None:
        """A request found ``worker_id`` gone: drop its entries now (not at its registry
        entry's expiry) and ignore its stream for ``suspect_s`` seconds; a worker that only
        blipped is read again from its last snapshot then."""
        self.index.drop(worker_id)
        self._suspects[worker_id] = time.monotonic() + suspect_s
        self._publish_gauges()

    # -- the KV event follower -----------------------------------------------------------------
    async def _follow(self) -> None:
        """Read every live worker's KV event stream into the index; drop the entries of
        workers that left the registry. Survives Redis outages (retries every second).

        The registry is listed again once a heartbeat interval, its own resolution, not at
        every read: a read returns as soon as any worker flushes events (every 20 ms while
        its cache changes, ``kv_events.FLUSH_S``), and listing the registry each time (a set
        and a hash per worker and role) was most of the gateway's Redis traffic and a fifth of
        its CPU per output token at 16 clients on the 2-core VM (docs/benchmarks.md, serving
        CPU)."""
        reader = KVEventReader(self.registry.redis)
        failing = False
        listed: dict[str, WorkerInfo] = {}
        listed_at = -math.inf
        while not self._stopping:
            try:
                now = time.monotonic()
                if now - listed_at >= self.registry.heartbeat_interval_s:
                    listed = {w.worker_id: w for role in ROLES
                              for w in await self.registry.list(role)}
                    listed_at = now
                self._suspects = {w: t for w, t in self._suspects.items() if t > now}
                workers = {i: w for i, w in listed.items() if i not in self._suspects}
                for gone in self.index.keep_only(workers):
                    log.info("prefix index: worker %s left the registry; its entries dropped", gone)
                self._sent = {w: s for w, s in self._sent.items() if w in workers}
                for batch in await reader.read(list(workers)):
                    self._apply(batch, workers.get(batch.worker_id))
                    # one batch at a time: a snapshot of a GPU worker's 100k-block cache took
                    # 93 ms to apply (2-core Xeon VM), all of it without relaying a token
                    await asyncio.sleep(0)
                if failing:
                    log.info("prefix index: reading KV events works again")
                failing = False
            except (redis.RedisError, OSError) as exc:
                if not failing:
                    log.warning("prefix index: reading KV events failed (%s); retrying", exc)
                failing = True
                await asyncio.sleep(1.0)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the follower must outlive a bad entry
                log.exception("prefix index: applying KV events failed")
                await asyncio.sleep(1.0)
            self._publish_gauges()

    def _apply(self, batch, worker: WorkerInfo | None) -> None:
        if batch.model != self.model or batch.hash_scheme != HASH_SCHEME:
            if batch.worker_id not in self._ignored:
                log.warning("prefix index: ignoring worker %s's KV events (model %r, hash %r; "
                            "this gateway serves %r with %r)", batch.worker_id, batch.model,
                            batch.hash_scheme, self.model, HASH_SCHEME)
                self._ignored.add(batch.worker_id)
            return
        if not self.index.apply(batch.worker_id, batch.epoch, batch.seq, batch.events,
                                worker.total_kv_blocks if worker else 0):
            log.warning("prefix index: KV events of worker %s were lost (batch %d of epoch %s "
                        "out of order); approximate until its next snapshot", batch.worker_id,
                        batch.seq, batch.epoch)
        self.num_events += 1
        if self.metrics is not None:
            self.metrics.kv_event_lag.observe(max(0.0, time.time() - batch.time_s))

    def _publish_gauges(self) -> None:
        if self.metrics is None:
            return
        modes = list(self.index.modes().values())
        self.metrics.kv_index_blocks.set(self.index.size)
        for mode in ("events", "approximate"):
            self.metrics.kv_index_workers[mode].set(modes.count(mode))


def _halved(seconds: float) -> float:
    """What a handoff measured ``seconds`` ago still counts (``HANDOFF_HALF_LIFE_S``)."""
    return 0.5 ** (max(seconds, 0.0) / HANDOFF_HALF_LIFE_S)


def _prompt_blocks(prompt: list[int], workers: list[WorkerInfo]) -> int:
    block_size = next((w.block_size for w in workers if w.block_size > 0), 16)
    return -(-len(prompt) // block_size)


__all__ = ["EVENTS", "MODES", "Route", "Router", "RoutingOptions", "Ticket"]
