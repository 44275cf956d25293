"""How many threads each engine step runs on: measured while serving, not assumed.

A step's kernels each split their work across the worker's OpenMP team: a fork and a join per
call, ~150 calls a decode step of the built-in model. When other processes share the cores (a
benchmark client, a sidecar, a noisy neighbour, the stack's own gateway), a team member that is
preempted stalls the rest at every join until the scheduler runs it again, so a step on every
thread can cost many times a step on one. Measured on 2 AMD EPYC cores with one busy-loop
process beside the server (issue 27): 16 streams fell to 2-4% of their quiet tokens/s. Quiet,
a second thread wins; beside a neighbour, one thread can win outright. So the engine measures,
for every step size.

``StepThreads("auto")``: steps are timed (wall clock, which is what TPOT and TTFT see) on one
thread and on all, per size bucket (1 | 2-3 | 4-7 | ... tokens), ``FIRST_SAMPLES`` times each in
turn, and then run on the faster by an exponentially weighted mean; one step in every
``EXPLORE_EVERY`` or more re-times the other choice, so a change in load is followed. The
interval grows with the gap so that re-timing costs at most ``MAX_EXPLORE_COST`` of the step
time (a choice twice as slow is re-timed every 100 steps, not 32), up to ``MAX_EXPLORE_EVERY``.
``"all"`` always uses every thread (the in-process default: figures that compare across runs).
The worker's thread count itself is capped by the CPU it may use (``cpus.available_cpus``:
affinity and cgroup quota). Outputs do not depend on the choice: every CPU kernel's result for
a row is the same whatever its thread count (tests/kernels/test_quant_tiles.py,
test_decode_fast_paths.py). (The 24 ms served TPOT on 2 threads once blamed on team joins was
libgomp's throttled spin: ``services.runtime.serve.on_passing_thread``.)
"""
from __future__ import annotations

import logging
import math

log = logging.getLogger(__name__)

EXPLORE_EVERY = 32  # per bucket: at most one slower step in this many
MAX_EXPLORE_COST = 0.01  # re-timing's share of the step time: (slow / fast - 1) / interval
MAX_EXPLORE_EVERY = 256  # the longest interval: a change in load is seen within this many steps
EWMA_WEIGHT = 0.2  # of the newest step time
FIRST_SAMPLES = 4  # steps timed on each choice, in turn, before the first decision (after
# one more that warms it up and is not counted)


class StepThreads:
    """Picks the thread count of each step (``choose``) and learns from its time (``record``).

    ``mode``: ``"auto"`` or ``"all"``; ``num_threads``: the worker's threads (>= 1). Raises
    ValueError naming ``step_threads`` for another mode.
    """

    def __init__(self, mode: str, num_threads: int) -> None:
        if mode not in ("auto", "all"):
            raise ValueError(f"step_threads: {mode!r} is not one of auto, all")
        self.num_threads = num_threads
        self.options = (1, num_threads) if mode == "auto" and num_threads > 1 else ()
        self._ms: dict[tuple[int, int], float] = {}  # (bucket, threads) -> mean wall ms
        self._timed: dict[tuple[int, int], int] = {}  # (bucket, threads) -> steps timed
        self._decided: set[int] = set()  # buckets whose first choice has been logged

    def choose(self, num_tokens: int) -> int:
        """Threads for a step of ``num_tokens`` tokens."""
        if not self.options:
            return self.num_threads
        bucket = num_tokens.bit_length()  # 1 | 2-3 | 4-7 | 8-15 | ... tokens
        timed = [self._timed.get((bucket, t), 0) for t in self.options]
        if min(timed) <= FIRST_SAMPLES:
            return self.options[timed.index(min(timed))]
        fast, slow = sorted(self.options, key=lambda t: self._ms[bucket, t])
        gap = self._ms[bucket, slow] / max(self._ms[bucket, fast], 1e-9) - 1
        every = min(max(EXPLORE_EVERY, math.ceil(gap / MAX_EXPLORE_COST)), MAX_EXPLORE_EVERY)
        if bucket not in self._decided:
            self._decided.add(bucket)
            lo, hi = 2 ** (bucket - 1), 2 ** bucket - 1
            log.info("steps of %s token(s) run on %d thread(s): %.1f ms against %.1f ms on %d "
                     "(re-timed every %d steps)", lo if lo == hi else f"{lo}-{hi}", fast,
                     self._ms[bucket, fast], self._ms[bucket, slow], slow, every)
        return slow if sum(timed) % every == 0 else fast

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        """The wall time of a step that ran ``num_tokens`` tokens on ``threads`` threads."""
        if not self.options:
            return
        key, ms = (num_tokens.bit_length(), threads), seconds * 1e3
        n = self._timed[key] = self._timed.get(key, 0) + 1
        if n == 1:
            return  # the warm-up step: caches and pages of this choice are cold
        old = self._ms.get(key, ms)
        self._ms[key] = old + (1 / (n - 1) if n <= FIRST_SAMPLES + 1 else EWMA_WEIGHT) * (ms - old)
