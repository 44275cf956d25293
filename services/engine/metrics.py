"""Counters an engine accumulates over its steps; benchmarks read and reset them."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scheduler import Scheduler, SchedulerOutput

STEP_PHASES = ("schedule", "prepare_inputs", "forward", "sample", "postprocess")


@dataclass
class EngineMetrics:
    """Sums over steps (divide by ``num_steps`` for means). Times in seconds, sizes in tokens.

    On CUDA the forward pass is asynchronous: ``forward`` then only covers the launch and the
    wait shows up in ``sample`` (which synchronises when it reads the tokens back).
    """

    num_steps: int = 0
    num_batched_tokens: int = 0  # tokens through the model
    num_scheduled_seqs: int = 0  # running batch size, summed over steps
    num_generated_tokens: int = 0
    kv_allocated_slots: int = 0  # block slots held by scheduled requests, summed over steps
    kv_used_slots: int = 0  # of those, slots holding a token's KV after the step
    kv_used_blocks: int = 0  # blocks in use in the whole pool, summed over steps
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found (their KV reused)
    num_preemptions: int = 0
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))

    def timed(self, phase: str, fn: Callable, *args):
        """``fn(*args)``, its wall time added to ``phase_s[phase]`` (seconds)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.phase_s[phase] += time.perf_counter() - t0

    def record_step(self, out: SchedulerOutput, scheduler: Scheduler, num_generated: int) -> None:
        """Add one step that ran ``out`` and generated ``num_generated`` tokens."""
        self.num_steps += 1
        self.num_batched_tokens += out.total_num_scheduled_tokens
        self.num_scheduled_seqs += len(out.scheduled)
        self.num_generated_tokens += num_generated
        bm = scheduler.block_manager
        bs = bm.block_size
        self.kv_allocated_slots += sum(len(r.block_table) for r in out.scheduled) * bs
        # a static batch's padding rows hold slots whose KV no request uses
        self.kv_used_slots += sum(min(r.num_computed_tokens, len(r.block_table) * bs)
                                  for r in out.scheduled if not r.is_padding)
        self.kv_used_blocks += bm.num_used_blocks
        self.num_preemptions = scheduler.num_preemptions
        self.prefix_cache_queries = scheduler.prefix_cache_queries  # cumulative, tokens
        self.prefix_cache_hits = scheduler.prefix_cache_hits

    @property
    def mean_batch_size(self) -> float:
        return self.num_scheduled_seqs / max(self.num_steps, 1)

    @property
    def kv_waste(self) -> float:
        """Allocated but unused slots / allocated slots (PagedAttention's internal waste)."""
        return 1.0 - self.kv_used_slots / max(self.kv_allocated_slots, 1)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / max(self.prefix_cache_queries, 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(mean_batch_size=self.mean_batch_size, kv_waste=self.kv_waste,
                 prefix_cache_hit_rate=self.prefix_cache_hit_rate)
        return d
