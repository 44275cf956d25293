"""A request's scheduling state (vLLM v1's model: no prefill or decode phase, only counters)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from operator import attrgetter

from .sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered so that every finished status compares greater than PREEMPTED."""

    WAITING = enum.auto()
    WAITING_FOR_KV = enum.auto()  # decode role: blocks reserved, prompt KV not yet arrived
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS or a stop token
    FINISHED_LENGTH = enum.auto()  # max_tokens or the model's context length
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a finished status, else None."""
        return _FINISH_REASONS.get(self)


# Readers of one field over a step's requests, for passes in C (``map(num_computed_of,
# requests)``): the engine's per-step work over its batch runs no Python statement per request.
request_id_of = attrgetter("request_id")
num_computed_of = attrgetter("num_computed_tokens")
block_table_of = attrgetter("block_table")
num_tokens_of = attrgetter("num_tokens")
status_of = attrgetter("status")
last_token_time_of = attrgetter("last_token_time")
is_padding_of = attrgetter("is_padding")

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False, slots=True)
class Request:
    """One sequence. ``num_computed_tokens`` counts tokens whose KV is in the cache."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # prefill role: keep the blocks after the first token until the KV has been sent
    hold_kv_on_finish: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # physical block ids, in order
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() when first admitted
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache when first admitted
    first_token_time: float | None = None  # time.monotonic() of the first output token
    last_token_time: float | None = None  # time.monotonic() of the newest output token
    # static batching: a row that keeps a finished member's slot computing until the batch
    # drains (greedy, its tokens discarded); never in ``Scheduler.requests``, never output
    is_padding: bool = False
    # chained hashes of the prompt's full blocks a prefix cache could hit (computed once, on
    # demand, by the scheduler: kv_events.prompt_block_hashes)
    block_hashes: list[int] | None = field(default=None, repr=False)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def only_decodes(self) -> bool:
        """Every token but the newest has its KV computed: the next step decodes one token
        (a running request's, or a remote prefill's once its prompt's KV has landed)."""
        return self.num_computed_tokens == self.num_tokens - 1

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids in positions ``[start, end)`` without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Finish status after the newest token was appended, or None to keep going."""
        # NOTE: runs for every request of every step
        output, params = self.output_token_ids, self.sampling_params
        last, num_output = output[-1], len(output)
        stop_token = (last == self.eos_token_id and not params.ignore_eos) or last in params.stop_token_ids
        if stop_token and num_output >= params.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or num_output + len(self.prompt_token_ids) >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
