"""Everything a service may ask of the engine thread: one small command per operation.

``EngineLoop.submit(command)`` queues one; the engine thread applies it between two steps
(``EngineLoop._apply`` dispatches on the type) and resolves the returned future with the result
named below, or with the exception the engine raised (``ValueError`` naming a field for bad
input). Reading ``LLMEngine.load()`` needs no command: plain int reads, safe from any thread.
"""
from __future__ import annotations

from dataclasses import dataclass

from .sampler import TokenLogprobs
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """Validate against the model, build a ``Request`` and queue it for scheduling, in one visit
    to the engine thread (each visit waits for the running step to end: a second one would add
    a whole step to TTFT). Result: the Request. ``hold_kv``: prefill role, keep the blocks after
    the first token until ``Release``. A ``ValueError`` means nothing was queued."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hold_kv: bool = False


@dataclass(frozen=True)
class Reserve:
    """Decode role: validate and build a ``Request`` and reserve blocks for its prompt's KV,
    written by a prefill worker (one visit, as ``AddRequest``). Result: the Request, or None
    when too few blocks are free (nothing reserved). A ``ValueError`` means nothing was held."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class FinishRemotePrefill:
    """Decode role: the prompt's KV has landed; admit the request with its first token.
    Result: the first token's RequestOutput, or None if it no longer waits for KV."""

    request_id: str
    first_token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class PrefillLocally:
    """Decode role: the KV will not arrive; compute the prompt here in the reserved blocks.
    Result: bool (False unless the request was waiting for KV)."""

    request_id: str


@dataclass(frozen=True)
class Abort:
    """Finish a request in any state and free its blocks. Result: bool (False if unknown)."""

    request_id: str


@dataclass(frozen=True)
class Release:
    """Prefill role: free a finished request's held blocks once its KV was sent. Result: None."""

    request_id: str


EngineCommand = (AddRequest | Reserve | FinishRemotePrefill | PrefillLocally
                 | Abort | Release)
