"""Iteration-level scheduler (continuous batching, Orca OSDI'22; vLLM v1's token-budget loop).

Every step: running requests first (decode, or the next chunk of a prompt), then waiting
requests are admitted while the token budget, ``max_num_seqs`` and free KV blocks allow. A
prompt longer than the remaining budget is split across steps (chunked prefill). A request
admitted with nothing computed (new, or preempted) starts after its longest prefix found in the
block manager's prefix cache; blocks that become full are registered after each step. When a
running request cannot get a block, the newest running request is preempted (its blocks freed,
its tokens recomputed later, mostly from the prefix cache), so the scheduler never deadlocks on
KV memory; no request is admitted in a step that preempted (vLLM v1).

With ``long_prefill_token_threshold`` T > 0, a prompt chunk is capped at T tokens in a step
where other requests wait behind it, so a short prompt queued behind a long one is admitted in
the same step instead of after the long prompt's last chunk (vLLM's
``long_prefill_token_threshold``; vLLM caps always, this caps only when someone waits).

``policy="static"`` is the subclass ``StaticScheduler`` (``static_batch.py``, the padded
static-batching baseline); ``create_scheduler`` (``policy.py``) picks the class from the config.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .outputs import RequestOutput
from .request import Request, RequestStatus

POLICIES = ("continuous", "static")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 2048  # tokens through the model per step
    max_model_len: int = 8192  # prompt + output tokens of one request
    # "continuous": admit every step; "static": a fixed batch, no admission until it drains,
    # KV preallocated to the longest sequence's maximum length per slot (the baseline)
    policy: str = "continuous"
    enable_prefix_caching: bool = True
    # tokens one prompt chunk may take in a step while other requests wait; 0: no cap
    long_prefill_token_threshold: int = 0
    # the model's window when every layer slides (Mistral): blocks before it are freed
    sliding_window: int | None = None


@dataclass
class SchedulerOutput:
    """What the model runner computes this step."""

    # requests in batch order; each computes tokens [num_computed_tokens, +num_scheduled)
    scheduled: list[Request] = field(default_factory=list)
    # request_id -> tokens scheduled this step
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # requests preempted this step (blocks already freed)
    preempted: list[Request] = field(default_factory=list)
    # requests finished (or released) since the previous step: the runner forgets them
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    ``max_model_len`` is capped at the pool's capacity (``num_blocks * block_size`` tokens): a
    sequence that reaches it finishes with "length" instead of preempting itself forever.
    Counters (cumulative): ``num_preemptions``; ``prefix_cache_queries`` tokens looked up at
    admission and ``prefix_cache_hits`` of them found in the prefix cache.

    Raises ``ValueError`` naming ``policy`` when the config asks for another class's policy
    (build schedulers with ``policy.create_scheduler``).
    """

    policy = "continuous"

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"policy: {config.policy!r} is not one of {POLICIES}")
        if config.policy != self.policy:
            raise ValueError(f"policy: {config.policy!r} needs its own scheduler class "
                             f"(use create_scheduler), not {type(self).__name__}")
        if config.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold: must be >= 0, got "
                             f"{config.long_prefill_token_threshold}")
        capacity = block_manager.num_blocks * block_manager.block_size
        self.config = dataclasses.replace(config, max_model_len=min(config.max_model_len, capacity))
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, and held ones
        self.finished_req_ids: set[str] = set()  # since the last schedule(), for the runner
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens
        self.prefix_cache_hits = 0  # tokens

    # -- admission ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve(self, request: Request) -> bool:
        """Decode role: allocate blocks for the prompt, whose KV another worker will write.

        Returns False (nothing allocated) when too few blocks are free.
        """
        if not self.block_manager.allocate_slots(request, request.num_prompt_tokens):
            return False
        request.status = RequestStatus.WAITING_FOR_KV
        self.requests[request.request_id] = request
        return True

    def finish_remote_prefill(self, request_id: str, first_token_id: int) -> RequestOutput | None:
        """Decode role: the prompt's KV has landed; append the first token and queue the request.
        The prompt's full blocks enter the prefix cache (their KV is now written)."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_KV:
            return None
        request.num_computed_tokens = request.num_prompt_tokens
        if self.config.enable_prefix_caching:
            self.block_manager.cache_full_blocks(request)
        self._free_outside_window(request)
        output = self._append_token(request, first_token_id)
        if not request.is_finished():
            request.status = RequestStatus.WAITING
            self.waiting.append(request)
        return output

    def prefix_hit(self, request: Request) -> list[int]:
        """Cached blocks to start ``request`` from: [] unless caching is on and nothing of the
        request is computed yet (new or preempted; a decode-role request has its prompt KV)."""
        if (not self.config.enable_prefix_caching or request.num_computed_tokens
                or request.sampling_params.prompt_logprobs is not None):  # every logit needed
            return []
        return self.block_manager.get_computed_blocks(request)

    def start_running(self, request: Request, hits: list[int]) -> None:
        """Move the head of ``waiting`` (blocks already allocated, ``hits`` included) to running."""
        self.waiting.popleft()
        if self.config.enable_prefix_caching and not request.num_computed_tokens:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(hits) * self.block_manager.block_size
        request.num_computed_tokens += len(hits) * self.block_manager.block_size
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = len(hits) * self.block_manager.block_size
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        self._schedule_new(out, budget)
        return out

    def _schedule_new(self, out: SchedulerOutput, budget: int) -> None:
        """Spend the budget left after the running requests (no admission after a preemption)."""
        if not out.preempted:
            self._schedule_waiting(out, budget)

    def _chunk(self, remaining: int, budget: int, others_waiting: bool) -> int:
        """Tokens to compute for a request with ``remaining`` uncomputed tokens."""
        num_new = min(remaining, budget)
        cap = self.config.long_prefill_token_threshold
        return min(num_new, cap) if cap and others_waiting else num_new

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Schedule running requests in order; returns the token budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget,
                                  bool(self.waiting))
            if not self._allocate_or_preempt(request, num_new, out):
                continue  # ``request`` itself was preempted: running[i] is now another request
            out.scheduled.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in arrival order (the head blocks the rest: FCFS)."""
        bs = self.block_manager.block_size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits = self.prefix_hit(request)
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens - len(hits) * bs,
                                  budget, len(self.waiting) > 1)
            if not self.block_manager.allocate_slots(request, num_new, hits):
                break
            self.start_running(request, hits)
            out.scheduled.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate for ``request``, preempting the newest running requests while needed."""
        while not self.block_manager.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: list[int | None]
    ) -> list[RequestOutput]:
        """Advance counters after the model ran ``out``; ``sampled_token_ids[i]`` belongs to
        ``out.scheduled[i]`` and is None for a prompt chunk that is not the prompt's last."""
        outputs = []
        for request, token_id in zip(out.scheduled, sampled_token_ids):
            if request.is_finished():  # aborted while the step ran
                continue
            request.num_computed_tokens += out.num_scheduled_tokens[request.request_id]
            if self.config.enable_prefix_caching:  # before a finish frees the blocks
                self.block_manager.cache_full_blocks(request)
            self._free_outside_window(request)
            if token_id is not None:
                outputs.append(self._append_token(request, token_id))
        if any(r.is_finished() for r in self.running):
            self.running = [r for r in self.running if not r.is_finished()]
        return outputs

    def _free_outside_window(self, request: Request) -> None:
        """Sliding window on every layer: free the blocks no later token attends to. Not for
        a prefill-role request, whose whole prompt's blocks are sent to the decode worker."""
        if self.config.sliding_window is not None and not request.hold_kv_on_finish:
            self.block_manager.free_blocks_outside_window(request, self.config.sliding_window)

    def _append_token(self, request: Request, token_id: int) -> RequestOutput:
        if request.sampling_params.max_tokens == 0:  # a scored prompt: nothing to generate
            self._finish(request, RequestStatus.FINISHED_LENGTH)
            return RequestOutput(request.request_id, [], "length", request.num_prompt_tokens, 0)
        request.output_token_ids.append(token_id)
        status = request.check_stop(self.config.max_model_len)
        if status is not None:
            self._finish(request, status)
        return RequestOutput(
            request.request_id,
            [token_id],
            status.finish_reason if status else None,
            request.num_prompt_tokens,
            len(request.output_token_ids),
        )

    # -- finishing ---------------------------------------------------------------------------
    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request.hold_kv_on_finish and status != RequestStatus.FINISHED_ABORTED:
            return  # the prefill worker frees it with release() once the KV was sent
        self.release(request.request_id)

    def release(self, request_id: str) -> None:
        """Free a finished request's blocks and forget it."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.block_manager.free(request)
            self.finished_req_ids.add(request_id)

    def abort(self, request_id: str) -> bool:
        """Finish a request in any state and free its blocks. Returns False if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request in self.waiting:
            self.waiting.remove(request)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self.release(request_id)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        # list() copies under the GIL: safe to call from another thread while the engine runs
        reserved = list(self.requests.values())
        return len(self.waiting) + sum(r.status == RequestStatus.WAITING_FOR_KV for r in reserved)
