"""What the engine hands back after a step, and the errors it raises to its callers."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one request after a step; ``finish_reason`` is set on its last output.

    ``error`` is set (and ``finish_reason`` is "abort") when the engine failed this request
    alone: its step raised because of it (see ``LLMEngine.step``); its blocks are already freed.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list | None = None  # per new token, when the request asked for logprobs
    # with the first output (or the finish of a scored prompt): per prompt token, None for the
    # first, else its TokenLogprobs, when the request asked for prompt_logprobs
    prompt_logprobs: list | None = None
    error: str | None = None  # why the engine failed this request (its cause, one line)


class EngineDeadError(RuntimeError):
    """The engine cannot continue: a step failed and the failure could not be attributed to
    the requests in it (or every request failed again). Every request it held is lost; the
    process serving it must stop."""
