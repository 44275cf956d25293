"""Iteration-level scheduler (continuous batching, Orca OSDI'22; vLLM v1's token-budget loop).

Every step: running requests first (decode, or the next chunk of a prompt), then waiting
requests are admitted while the token budget, ``max_num_seqs`` and free KV blocks allow. A
prompt longer than the remaining budget is split across steps (chunked prefill). A request
admitted with nothing computed (new, or preempted) starts after its longest prefix found in the
block manager's prefix cache; blocks that become full are registered after each step. When a
running request cannot get a block, the newest running request is preempted (its blocks freed,
its tokens recomputed later, mostly from the prefix cache), so the scheduler never deadlocks on
KV memory; no request is admitted in a step that preempted (vLLM v1).

A waiting request whose next uncached block a running request is computing right now waits
until that block is cached (SGLang's scheduler likewise keeps two prompts from computing one
prefix twice); it is passed over, not blocking the queue.

With ``long_prefill_token_threshold`` T > 0, a prompt chunk is capped at T tokens in a step
where other requests wait behind it, so a short prompt queued behind a long one is admitted in
the same step instead of after the long prompt's last chunk (vLLM's
``long_prefill_token_threshold``; vLLM caps always, this caps only when someone waits).

Waiting order (``queue_policy``): ``fcfs`` admits in arrival order (the head blocks the rest);
``srpt`` admits the waiting request with the least work left first, aged so that none starves:
its key is ``arrival + remaining_tokens x seconds_per_token`` (shortest remaining processing
time, Schrage 1968, with linear aging; the engine measures a prompt token's seconds, 1 /
``queue_aging_tokens_per_s`` until it has), lowest first. A request that arrived at t needing
S seconds alone is therefore admitted before any request that arrives after ``t + S``: its wait
is bounded by its own service time plus the time to serve what arrived before then.

Time-budgeted steps: with ``step_token_budget`` B set (the engine sets it each step from the
measured step cost and ``max_step_ms``, with ``decode_row_tokens`` W, what a decode row costs a
step in prompt tokens), a step that carries R decode rows computes at most B - R x W prompt
tokens (at least one block), so a running stream's inter-token gap stays near the budget while
prompts are computed beside it (Sarathi-Serve's stall-free batching; ``step_cost.py``).

``policy="static"`` is the subclass ``StaticScheduler`` (``static_batch.py``, the padded
static-batching baseline); ``create_scheduler`` (``policy.py``) picks the class from the config.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import repeat

from .block_manager import BlockManager
from .engine_config import QUEUE_POLICIES
from .kv_events import prompt_block_hashes
from .outputs import RequestOutput
from .request import Request, RequestStatus

POLICIES = ("continuous", "static")
QUEUE_AGING_TOKENS_PER_S = 1000.0  # srpt: prefill speed assumed until the engine measures it


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
    # order of admission: "fcfs" (arrival) or "srpt" (least work left first, aged; see above)
    queue_policy: str = "fcfs"
    queue_aging_tokens_per_s: float = QUEUE_AGING_TOKENS_PER_S
    # the model's window when every layer slides (Mistral): blocks before it are freed
    sliding_window: int | None = None
    # the sliding layers' window when other layers attend to everything (Gemma): blocks stay
    mixed_sliding_window: int | None = None


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
        if config.queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"queue_policy: {config.queue_policy!r} is not one of {QUEUE_POLICIES}")
        if not config.queue_aging_tokens_per_s > 0:
            raise ValueError("queue_aging_tokens_per_s: must be > 0, got "
                             f"{config.queue_aging_tokens_per_s}")
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
        # budget of a step with decode rows, in prompt tokens, each row taking
        # decode_row_tokens of it (None: no limit); set by the engine
        self.step_token_budget: int | None = None
        self.decode_row_tokens = 1.0
        # measured seconds one prompt token costs (None: not known); set by the engine
        self.seconds_per_token: float | None = None
        self._prefill_left = config.max_num_batched_tokens  # prompt tokens left this step
        self._yielded: list[Request] = []  # prompt chunks passed over for waiting requests

    # -- admission ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve(self, request: Request) -> bool:
        """Decode role: allocate blocks for the prompt, whose KV another worker will write.

        The longest prefix of the prompt already in this worker's prefix cache is pinned
        (shared, ref-counted) instead: its tokens are ``request.num_cached_tokens`` and only
        the blocks after them are for the writer (``block_table[num_cached_tokens //
        block_size:]``). Returns False (nothing allocated) when too few blocks are free.
        """
        hits = self.prefix_hit(request)
        cached = len(hits) * self.block_manager.block_size
        if not self.block_manager.allocate_slots(request, request.num_prompt_tokens - cached, hits):
            return False
        if self.config.enable_prefix_caching:
            self.prefix_cache_queries += request.num_prompt_tokens
            self.prefix_cache_hits += cached
        request.num_cached_tokens = cached
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
            # a gap of unwritten blocks, or blocks the sliding layers left unwritten
            if self.skipped_prompt_blocks(request) or self.partial_prompt_blocks(request):
                self.block_manager.never_cache(request)
            self.block_manager.cache_full_blocks(request)
        self._free_outside_window(request)
        output = self._append_token(request, first_token_id)
        if not request.is_finished():
            request.status = RequestStatus.WAITING
            self.waiting.append(request)
        return output

    def admit_decoding(self) -> bool:
        """Async scheduling (engine.py's ``_launch_ahead``): admit every waiting request, as
        ``schedule()`` would, when each only decodes (a remote prefill's, its prompt's K/V
        landed), room allows, and its next token's slot is allocated. False (none admitted)
        otherwise: the next step is scheduled as usual."""
        room = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        if len(self.running) + len(self.waiting) > room or not all(
                r.only_decodes for r in self.waiting):
            return False
        self._order_waiting()
        if not all(self.block_manager.allocate_slots(r, 1) for r in self.waiting):
            return False
        while self.waiting:
            self.start_running(self.waiting[0], [])
        return True

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
        self._prefill_left = self._prefill_budget()
        self._yielded = []
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        self._schedule_new(out, budget)
        self._schedule_yielded(out)
        return out

    def _prefill_budget(self) -> int:
        """Prompt tokens this step may compute: what ``step_token_budget`` leaves after the
        decode rows, ``decode_row_tokens`` each (at least one block), or no limit without rows
        or budget."""
        budget = self.step_token_budget
        if budget is None:
            return self.config.max_num_batched_tokens
        rows = sum(1 for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens)
        if not rows:
            return self.config.max_num_batched_tokens
        return max(self.block_manager.block_size, int(budget - rows * self.decode_row_tokens))

    def _order_waiting(self) -> None:
        """``srpt``: put the waiting request with the lowest aged key first (module docstring)."""
        if self.config.queue_policy != "srpt" or len(self.waiting) < 2:
            return
        self.waiting = deque(sorted(self.waiting, key=self._key))

    def _schedule_new(self, out: SchedulerOutput, budget: int) -> None:
        """Spend the budget left after the running requests (no admission after a preemption)."""
        if not out.preempted:
            self._schedule_waiting(out, budget)

    def _chunk(self, remaining: int, budget: int, others_waiting: bool) -> int:
        """Tokens to compute for a request with ``remaining`` uncomputed tokens (a prompt
        chunk counts against this step's prefill budget; a decode row's one token does not)."""
        num_new = min(remaining, budget)
        cap = self.config.long_prefill_token_threshold
        if cap and others_waiting:
            num_new = min(num_new, cap)
        if remaining > 1:
            num_new = min(num_new, self._prefill_left)
            self._prefill_left -= num_new
        return num_new

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Schedule running requests in order; returns the token budget left. Under ``srpt`` a
        prompt still prefilling whose key is above an admissible waiting request's yields: it
        gets what the waiting ones leave (``_schedule_yielded``), so a long prompt's chunks do
        not hold every short prompt behind them."""
        i, first_waiting = 0, self._lowest_waiting_key()
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if (request.num_computed_tokens < request.num_prompt_tokens
                    and self._key(request) > first_waiting):
                self._yielded.append(request)
                i += 1
                continue
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget,
                                  bool(self.waiting))
            if num_new == 0:  # a prompt chunk over this step's time budget: next step
                i += 1
                continue
            if not self._allocate_or_preempt(request, num_new, out):
                continue  # ``request`` itself was preempted: running[i] is now another request
            out.scheduled.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in ``queue_policy`` order (the head blocks the rest), passing
        over those whose next uncached block another request is computing now."""
        bs = self.block_manager.block_size
        self._order_waiting()
        pending, deferred = self._blocks_in_progress(), []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits = self.prefix_hit(request)
            if self._waits_for(request, hits, pending):
                deferred.append(self.waiting.popleft())
                continue
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens - len(hits) * bs,
                                  budget, len(self.waiting) > 1)
            if num_new == 0 or not self.block_manager.allocate_slots(request, num_new, hits):
                break
            self.start_running(request, hits)
            out.scheduled.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
            if self.config.enable_prefix_caching:
                pending.update(self._hashes(request)[len(hits):])
        self.waiting.extendleft(reversed(deferred))

    # -- prompts that share a prefix being computed ------------------------------------------
    # A request admitted while another computes the same prefix would compute it a second
    # time (neither's blocks are in the cache yet); held back until those blocks are cached,
    # it finds them there. It waits at most as long as the computing request's prefill.

    def _hashes(self, request: Request) -> list[int]:
        if request.block_hashes is None:
            request.block_hashes = prompt_block_hashes(request.prompt_token_ids,
                                                       self.block_manager.block_size)
        return request.block_hashes

    def _blocks_in_progress(self) -> set[int]:
        """Hashes of the prompt blocks that running requests have yet to compute."""
        if not self.config.enable_prefix_caching:
            return set()
        bs = self.block_manager.block_size
        return {h for r in self.running if r.num_computed_tokens < r.num_prompt_tokens
                for h in self._hashes(r)[r.num_computed_tokens // bs:]}

    def _waits_for(self, request: Request, hits: list[int], pending: set[int]) -> bool:
        """Whether ``request`` (nothing computed yet) should wait: the block after its cached
        prefix is one a running request is computing."""
        if not pending or request.num_computed_tokens:
            return False
        hashes = self._hashes(request)
        return len(hits) < len(hashes) and hashes[len(hits)] in pending

    def _schedule_yielded(self, out: SchedulerOutput) -> None:
        """The prompt chunks that yielded to waiting requests, from the budget those left
        (no preemption: what this step scheduled stays scheduled)."""
        budget = self.config.max_num_batched_tokens - out.total_num_scheduled_tokens
        for request in self._yielded:
            if budget <= 0:
                break
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget,
                                  bool(self.waiting))
            if num_new == 0 or not self.block_manager.allocate_slots(request, num_new):
                continue
            out.scheduled.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new

    def _key(self, request: Request) -> float:
        """``srpt``'s key (lowest goes first): arrival + its uncomputed tokens' time, by the
        measured ``seconds_per_token`` (until measured, 1 / ``queue_aging_tokens_per_s``)."""
        per_token = self.seconds_per_token or 1.0 / self.config.queue_aging_tokens_per_s
        return request.arrival_time + (request.num_tokens - request.num_computed_tokens) * per_token

    def _lowest_waiting_key(self) -> float:
        """The lowest ``srpt`` key of a waiting request that could start now (not one held
        back for a prefix in progress); infinity under ``fcfs`` or with none."""
        if self.config.queue_policy != "srpt" or not self.waiting:
            return float("inf")
        pending = self._blocks_in_progress()
        keys = [self._key(r) for r in self.waiting if not pending or r.num_computed_tokens
                or not self._waits_for(r, self._cached_prefix(r), pending)]
        return min(keys, default=float("inf"))

    def _cached_prefix(self, request: Request) -> list[int]:
        """A stand-in for ``prefix_hit`` by the memoised hashes: as many entries as leading
        blocks of the prompt the cache holds (cheap: no token hashing)."""
        cached = self.block_manager.cached_prefix_blocks(self._hashes(request))
        return [0] * cached

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
        self, out: SchedulerOutput, sampled_token_ids: list[int | None],
        stop_checks: list[bool] | None = None,
    ) -> list[RequestOutput]:
        """Advance counters after the model ran ``out``; ``sampled_token_ids[i]`` belongs to
        ``out.scheduled[i]`` and is None for a prompt chunk that is not the prompt's last.
        ``stop_checks[i]``: whether that token may end its request (the model runner's
        vectorised test, ``InputBatch.record_sampled``); False skips the stop test
        (``Request.check_stop``); None tests every token."""
        outputs, finished = [], False
        # NOTE: runs for every request of every step: settings and methods looked up once
        num_scheduled, running = out.num_scheduled_tokens, RequestStatus.PREEMPTED
        cache_full_blocks, bs = self.block_manager.cache_full_blocks, self.block_manager.block_size
        caching, sliding = self.config.enable_prefix_caching, self.config.sliding_window is not None
        checks = repeat(True) if stop_checks is None else stop_checks
        for request, token_id, check in zip(out.scheduled, sampled_token_ids, checks):
            if request.status > running:  # finished: aborted while the step ran
                continue
            n = num_scheduled[request.request_id]
            request.num_computed_tokens = computed = request.num_computed_tokens + n
            # before a finish frees the blocks; a decode row (every other advance registers
            # what it filled) fills a block only when it computes the block's last slot
            if caching and (n != 1 or computed % bs == 0):
                cache_full_blocks(request)
            if sliding:
                self._free_outside_window(request)
            if token_id is None:
                continue
            if check:
                outputs.append(output := self._append_token(request, token_id))
                finished = finished or output.finish_reason is not None
            else:  # the usual row: no stop token, no length limit reached
                (tokens := request.output_token_ids).append(token_id)
                outputs.append(RequestOutput(request.request_id, [token_id], None,
                                             len(request.prompt_token_ids), len(tokens)))
        if finished:  # (an abort removes its request from running itself)
            self.running = [r for r in self.running if not r.is_finished()]
        return outputs

    def skipped_prompt_blocks(self, request: Request) -> int:
        """Decode role: the prompt's blocks after its cached prefix that no token still to come
        reads (every layer slides: before the window of the token after the prompt), so a
        remote prefill need not write them (``KVReservation.num_skipped_blocks``)."""
        return self._blocks_before_window(request, self.config.sliding_window)

    def partial_prompt_blocks(self, request: Request) -> int:
        """Decode role: the prompt's blocks after its cached prefix that only the global layers
        read (sliding and global layers mixed: before the sliding layers' window of the token
        after the prompt), so a remote prefill writes them for those layers alone
        (``KVReservation.num_partial_blocks``)."""
        return self._blocks_before_window(request, self.config.mixed_sliding_window)

    def _blocks_before_window(self, request: Request, window: int | None) -> int:
        if window is None:
            return 0
        bm = self.block_manager
        cached = max(request.num_cached_tokens, 0) // bm.block_size
        before = bm.blocks_before_window(request.num_prompt_tokens, window)
        last = bm.blocks_needed(request.num_prompt_tokens) - 1  # a handoff writes one at least
        return max(min(before, last) - cached, 0)

    def _free_outside_window(self, request: Request) -> None:
        """Sliding window on every layer: free the blocks no later token attends to. Not for
        a prefill-role request, whose whole prompt's blocks are sent to the decode worker."""
        if self.config.sliding_window is not None and not request.hold_kv_on_finish:
            self.block_manager.free_blocks_outside_window(request, self.config.sliding_window)

    def _append_token(self, request: Request, token_id: int) -> RequestOutput:
        if request.sampling_params.max_tokens == 0:  # a scored prompt: nothing to generate
            self._finish(request, RequestStatus.FINISHED_LENGTH)
            return RequestOutput(request.request_id, [], "length", request.num_prompt_tokens, 0)
        output = request.output_token_ids
        output.append(token_id)
        status = request.check_stop(self.config.max_model_len)
        if status is not None:
            self._finish(request, status)
        return RequestOutput(request.request_id, [token_id],
                             None if status is None else status.finish_reason,
                             len(request.prompt_token_ids), len(output))

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
    def num_prefill_tokens(self) -> int:
        """Prompt tokens not computed yet of the requests queued or prefilling here (a
        worker's queued prefill work; plain reads, safe from another thread)."""
        pending = list(self.waiting) + list(self.running)
        return sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in pending
                   if r.status != RequestStatus.WAITING_FOR_KV)

    @property
    def num_waiting(self) -> int:
        # list() copies under the GIL: safe to call from another thread while the engine runs
        reserved = list(self.requests.values())
        return len(self.waiting) + sum(r.status == RequestStatus.WAITING_FOR_KV for r in reserved)
