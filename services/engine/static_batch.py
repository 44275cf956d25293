"""Static batching: the baseline continuous batching is measured against (Orca OSDI'22, section
2.2; the fixed-shape batches of FasterTransformer-style servers and of ``transformers``
``generate``).

A batch of up to ``max_num_seqs`` waiting requests is admitted only when the previous batch has
fully drained. Each slot gets KV blocks for the batch's longest prompt plus its longest
``max_tokens`` (capped at ``max_model_len``): the shape of a left-padded batch. The batch keeps
its shape until it drains: when a member finishes, its output ends as usual, and a padding row
takes over its slot and keeps decoding (greedy, tokens discarded), as a finished row of a
fixed-shape batch does. Prompts are still computed in chunks within the token budget and
without padding, and prefix-cache hits are used.
"""
from __future__ import annotations

from itertools import islice

from .outputs import RequestOutput
from .request import Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput

_PADDING_PARAMS = SamplingParams(temperature=0, ignore_eos=True)


class StaticScheduler(Scheduler):
    """``policy="static"``: the ``Scheduler`` with static admission, max-length slots and
    padding rows (overrides ``schedule``, ``_schedule_new``, ``update_from_output``, ``_finish``
    and ``abort``, each calling the base class, and ``_free_outside_window``: slots keep their
    blocks)."""

    policy = "static"

    def __init__(self, config, block_manager) -> None:
        super().__init__(config, block_manager)
        self.padding: list[Request] = []  # rows standing in for finished members

    # -- the base class's hooks --------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._admit_batch()
        return super().schedule()

    def _schedule_new(self, out: SchedulerOutput, budget: int) -> None:
        """Padding rows instead of admission: a static batch admits only once it drained."""
        self._schedule_padding(out, budget)

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: list[int | None],
                           stop_checks: list[bool] | None = None) -> list[RequestOutput]:
        """As ``Scheduler``'s, padding rows apart; every member's token is stop-tested."""
        members, tokens = [], []
        for request, token_id in zip(out.scheduled, sampled_token_ids):
            if request.is_padding:
                request.num_computed_tokens += 1
                request.output_token_ids.append(token_id)
            else:
                members.append(request)
                tokens.append(token_id)
        outputs = super().update_from_output(
            SchedulerOutput(members, out.num_scheduled_tokens, out.preempted, set()), tokens)
        if not self.running:
            self._release_slots()  # the batch drained
        return outputs

    def _free_outside_window(self, request: Request) -> None:
        """Nothing: a static slot keeps its max-length blocks until the batch drains (and a
        padding row inherits its member's whole block table)."""

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status != RequestStatus.RUNNING or request.hold_kv_on_finish:
            super()._finish(request, status)
            return
        request.status = status
        self.requests.pop(request.request_id, None)
        self._hold_slot(request)  # a padding row until the whole batch has drained

    def abort(self, request_id: str) -> bool:
        found = super().abort(request_id)
        if not self.running:
            self._release_slots()
        return found

    # -- slots and padding rows --------------------------------------------------------------
    def _hold_slot(self, request: Request) -> None:
        """``request`` (a member) finished: a padding row takes over its blocks."""
        pad = Request(f"{request.request_id}/padding", request.all_token_ids, _PADDING_PARAMS,
                      status=RequestStatus.RUNNING, is_padding=True)
        pad.num_computed_tokens = request.num_computed_tokens
        pad.block_table, request.block_table = request.block_table, []
        self.block_manager.free(request)  # no blocks left: drops its cache chain
        self.padding.append(pad)

    def _schedule_padding(self, out: SchedulerOutput, budget: int) -> None:
        """Add one decode token per padding row to ``out``, within the token budget. A row
        whose slot is full stays idle (it never takes another block) until the batch drains."""
        bs = self.block_manager.block_size
        for pad in self.padding:
            if budget <= 0:
                return
            if (pad.num_computed_tokens < len(pad.block_table) * bs
                    and pad.num_tokens < self.config.max_model_len):
                out.scheduled.append(pad)
                out.num_scheduled_tokens[pad.request_id] = 1
                budget -= 1

    def _release_slots(self) -> None:
        """Free the padding rows' slots (call once no member runs: the batch drained)."""
        for pad in self.padding:
            self.block_manager.free(pad)
            self.finished_req_ids.add(pad.request_id)
        self.padding.clear()

    # -- admission ---------------------------------------------------------------------------
    def _admit_batch(self) -> None:
        """If no member runs, free the old batch's slots and admit the next batch.

        The batch is the longest run of waiting requests, in arrival order, whose max-length
        slots all fit the free blocks. When not even one slot fits (blocks held by other
        workers' transfers), the head is admitted with blocks for its first chunk only; it grows
        on demand and may be preempted like in continuous mode, so admission never deadlocks.
        """
        if self.running:
            return
        self._release_slots()
        batch, slot_len = self._pick()
        bm = self.block_manager
        for request in batch:
            hits = self.prefix_hit(request)
            num_new = slot_len - request.num_computed_tokens - len(hits) * bm.block_size
            # fits: ``_pick`` counted every slot as all-new blocks, a hit costs at most one
            bm.allocate_slots(request, num_new, hits)
            self.start_running(request, hits)
        if not batch and self.waiting:
            self._admit_first_chunk(self.waiting[0])

    def _pick(self) -> tuple[list[Request], int]:
        """Requests of the next batch and its slot length in tokens."""
        bm = self.block_manager
        batch: list[Request] = []
        longest_prompt = longest_output = slot_len = 0
        for request in islice(self.waiting, self.config.max_num_seqs):
            prompt = max(longest_prompt, request.num_prompt_tokens)
            output = max(longest_output, request.sampling_params.max_tokens)
            length = min(prompt + output, self.config.max_model_len)
            if (len(batch) + 1) * bm.blocks_needed(length) > bm.num_free_blocks:
                break
            batch.append(request)
            longest_prompt, longest_output, slot_len = prompt, output, length
        return batch, slot_len

    def _admit_first_chunk(self, request: Request) -> None:
        hits = self.prefix_hit(request)
        bs = self.block_manager.block_size
        remaining = request.num_tokens - request.num_computed_tokens - len(hits) * bs
        num_new = min(remaining, self.config.max_num_batched_tokens)
        if self.block_manager.allocate_slots(request, num_new, hits):
            self.start_running(request, hits)
