"""Static batching: the baseline continuous batching is measured against (Orca OSDI'22, section
2.2; the padded batches of FasterTransformer-style servers).

A batch of up to ``max_num_seqs`` waiting requests is admitted only when the previous batch has
fully drained. Each slot gets KV blocks for the batch's longest ``prompt + max_tokens`` (capped
at ``max_model_len``), as a padded static batch would, and keeps them until the whole batch has
finished. Prompts are still computed in chunks within the token budget, and prefix-cache hits
are used, so the baseline is no worse than padding and drain-before-admit make it.
"""
from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING

from .request import Request

if TYPE_CHECKING:
    from .scheduler import Scheduler


class StaticBatcher:
    """Admission and slot bookkeeping of ``policy="static"`` for one ``Scheduler``."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.held: list[Request] = []  # finished members whose slots the batch still holds

    def hold_slot(self, request: Request) -> None:
        self.held.append(request)

    def release_slots(self) -> None:
        """Free the slots of finished members (call once no member runs)."""
        for request in self.held:
            self.scheduler.block_manager.free(request)
        self.held.clear()

    def admit(self) -> None:
        """If no member runs, free the old batch's slots and admit the next batch.

        The batch is the longest run of waiting requests, in arrival order, whose max-length
        slots all fit the free blocks. When not even one slot fits (blocks held by other
        workers' transfers), the head is admitted with blocks for its first chunk only; it grows
        on demand and may be preempted like in continuous mode, so admission never deadlocks.
        """
        s = self.scheduler
        if s.running:
            return
        self.release_slots()
        batch, slot_len = self._pick()
        bm = s.block_manager
        for request in batch:
            hits = s.prefix_hit(request)
            num_new = slot_len - request.num_computed_tokens - len(hits) * bm.block_size
            # fits: ``_pick`` counted every slot as all-new blocks, a hit costs at most one
            bm.allocate_slots(request, num_new, hits)
            s.start_running(request, hits)
        if not batch and s.waiting:
            self._admit_first_chunk(s.waiting[0])

    def _pick(self) -> tuple[list[Request], int]:
        """Requests of the next batch and its slot length in tokens."""
        s = self.scheduler
        bm = s.block_manager
        batch: list[Request] = []
        slot_len = 0
        for request in islice(s.waiting, s.config.max_num_seqs):
            longest = request.num_prompt_tokens + request.sampling_params.max_tokens
            length = min(max(slot_len, longest), s.config.max_model_len)
            if (len(batch) + 1) * bm.blocks_needed(length) > bm.num_free_blocks:
                break
            batch.append(request)
            slot_len = length
        return batch, slot_len

    def _admit_first_chunk(self, request: Request) -> None:
        s = self.scheduler
        hits = s.prefix_hit(request)
        bs = s.block_manager.block_size
        remaining = request.num_tokens - request.num_computed_tokens - len(hits) * bs
        num_new = min(remaining, s.config.max_num_batched_tokens)
        if s.block_manager.allocate_slots(request, num_new, hits):
            s.start_running(request, hits)
