"""Routing by cost: pure functions of (request, worker state), so every rule is unit-testable
without a process (STYLE.md: llm-d's scorer pipeline, Dynamo's KV router cost).

For one request of ``prompt_blocks`` full blocks, each candidate worker costs

    cost = weight x compute_blocks + load
    compute_blocks = prompt_blocks - overlap_blocks       (blocks it would compute or receive)
    load = queued_prefill_tokens / block_size + num_running  (in blocks of work, see below)

and the lowest cost wins, ties broken at random; with ``temperature`` > 0 the first choice is
sampled with probability ~ exp(-normalised cost / temperature) instead (Dynamo's
``--router-temperature``: costs scaled to [0, 1] by their range). ``weight`` is Dynamo's
``--kv-overlap-score-weight``: 0 ignores every cache (pure load balancing), higher values favour
cache hits (TTFT) over spreading work. The load counts the prompt tokens already queued or
prefilling there in blocks (what this prompt waits behind) and one block per running sequence
(what every step of it costs beside decode rows: each row is about one token of compute per step
for the rest of its output). KV blocks in use enter as a filter: a worker with fewer free
blocks than the request needs is ranked after every worker with room (it would refuse, or
preempt), whatever its cost.

Conditional disaggregation (``local_prefill_reason``): the decode worker computes the prompt
itself when its uncached part is at most ``threshold_tokens`` (llm-d's P/D threshold), or when
computing it there takes less time than the remote path spends before computing it and beside
it: the wait in the prefill worker's queue plus the KV handoff (Dynamo's conditional
disaggregation weighs the prefill queue too). The remote prefill's own compute is left out of
the remote side: it runs beside the decode worker's streams, which a local prefill stalls
(its chunks ride in their steps), so it is the margin local must win by. Times come from the
seconds a prompt token adds to each worker's steps and the handoff seconds the gateway
measures per (prefill, decode) pair (``Router.observe_handoff``).

Not counted: how many streams the decode worker runs. Counting the prompt's time once more for
each (the delay it adds to every stream) kept every 512-token prompt of a 16-client CPU run on
the prefill worker: TPOT about half and mean end-to-end latency 13% lower, but TTFT p50 6-7.6 s
against 1.7 s (docs/benchmarks.md, "Conditional disaggregation and the KV handoff").
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

# why a worker was chosen (the gateway counts decisions by reason: routing_decisions_total)
KV_OVERLAP = "kv_overlap"  # it held the longest cached prefix and that decided it
LOAD = "load"              # by load alone: no cached prefix anywhere, weight 0, or load won
THRESHOLD = "threshold"    # prefilled on the decode worker: uncached part under the threshold
QUEUE = "queue"            # prefilled on the decode worker: the prefill queue and the KV
                           # handoff would take longer
FALLBACK = "fallback"      # the better-ranked workers refused or failed; a later one served
RANDOM = "random"          # routing random
REASONS = (KV_OVERLAP, LOAD, THRESHOLD, QUEUE, FALLBACK, RANDOM)


@dataclass(frozen=True)
class Candidate:
    """One worker as the scorer sees it; blocks are of the worker's own block size."""

    worker_id: str
    overlap_blocks: int = 0            # prompt blocks in its prefix cache (longest prefix)
    queued_prefill_tokens: int = 0     # prompt tokens queued or prefilling there
    num_running: int = 0               # sequences in its running batch
    free_kv_blocks: int = 1 << 30      # blocks it can still give
    block_size: int = 16
    seconds_per_token: float = 0.0     # measured step cost per token (0: unknown)

    def load(self) -> float:
        """Work it already carries, in blocks (module docstring)."""
        return self.queued_prefill_tokens / self.block_size + self.num_running

    def uncached_tokens(self, num_prompt_tokens: int) -> int:
        """The prompt's tokens after the prefix its cache holds: what it would compute, or
        receive."""
        return max(num_prompt_tokens - self.overlap_blocks * self.block_size, 0)


@dataclass(frozen=True)
class Scored:
    candidate: Candidate
    cost: float
    has_room: bool


def cost(c: Candidate, prompt_blocks: int, weight: float) -> float:
    """``weight x (prompt_blocks - overlap) + load`` (module docstring). Raises ValueError on
    a negative weight."""
    if weight < 0:
        raise ValueError(f"weight must be >= 0, got {weight}")
    compute = prompt_blocks - min(c.overlap_blocks, prompt_blocks) if weight else 0
    return weight * compute + c.load()


def rank(candidates: list[Candidate], prompt_blocks: int, weight: float,
         temperature: float = 0.0, rng: random.Random | None = None) -> list[Scored]:
    """``candidates`` best first: workers with room before those without, then by cost, ties
    in random order; with ``temperature`` > 0 the first is sampled by softmax of the
    normalised costs among those with room. ``prompt_blocks``: blocks of the whole prompt
    (the KV the worker must end up holding, for the room check)."""
    rng = rng or random
    scored = [Scored(c, cost(c, prompt_blocks, weight),
                     c.free_kv_blocks >= prompt_blocks - min(c.overlap_blocks, prompt_blocks))
              for c in candidates]
    ties = {s.candidate.worker_id: rng.random() for s in scored}
    scored.sort(key=lambda s: (not s.has_room, s.cost, ties[s.candidate.worker_id]))
    if temperature > 0 and len(scored) > 1:
        pool = [s for s in scored if s.has_room] or scored
        first = _softmax_pick(pool, temperature, rng)
        scored.remove(first)
        scored.insert(0, first)
    return scored


def _softmax_pick(pool: list[Scored], temperature: float, rng: random.Random) -> Scored:
    lo, hi = min(s.cost for s in pool), max(s.cost for s in pool)
    span = (hi - lo) or 1.0
    weights = [math.exp(-((s.cost - lo) / span) / temperature) for s in pool]
    return rng.choices(pool, weights=weights)[0]


def reason(chosen: Candidate, candidates: list[Candidate], weight: float) -> str:
    """Why ``chosen`` won: ``KV_OVERLAP`` when it holds the longest cached prefix of any
    candidate (and some prefix at all) with weight > 0; else ``LOAD``."""
    best = max((c.overlap_blocks for c in candidates), default=0)
    return KV_OVERLAP if weight > 0 and best > 0 and chosen.overlap_blocks == best else LOAD


def local_prefill_reason(num_prompt_tokens: int, decode: Candidate, prefill: Candidate | None,
                         threshold_tokens: int, handoff_s: float = 0.0) -> str | None:
    """Whether the decode worker should compute the prompt itself instead of a prefill worker
    (never with ``threshold_tokens`` 0: conditional disaggregation off):
    ``THRESHOLD`` when the part not in its cache is at most ``threshold_tokens``; ``QUEUE`` when
    computing it there (its queued + the uncached tokens, x its seconds per token) takes less
    than the prompt would wait in the queue of the best prefill worker ``prefill`` (its queued
    tokens x its seconds per token) plus ``handoff_s``, what handing the prompt's KV from that
    worker to this one is expected to take (seconds); both seconds per token measured, else
    no. Else None (``prefill`` None: no prefill worker to compare with)."""
    if threshold_tokens <= 0:
        return None
    uncached = decode.uncached_tokens(num_prompt_tokens)
    if uncached <= threshold_tokens:
        return THRESHOLD
    if prefill is None or decode.seconds_per_token <= 0 or prefill.seconds_per_token <= 0:
        return None
    here = (decode.queued_prefill_tokens + uncached) * decode.seconds_per_token
    there = prefill.queued_prefill_tokens * prefill.seconds_per_token + handoff_s
    return QUEUE if here < there else None
