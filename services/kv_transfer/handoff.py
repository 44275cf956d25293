"""The engine-side hooks of a KV handoff: what an engine offers so that a prompt computed on a
prefill worker is decoded on another worker, while ``KVTransport`` moves the blocks between them.

vLLM's KV connector base class (``KVConnectorBase_V1``) names the hooks of a handoff in one
class and groups them by side (scheduler side: ``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``request_finished`` with its delayed free; worker side:
``start_load_kv``, ``save_kv_layer``, ``get_finished``). Here the engine implements the hooks
(``LLMEngine``, checked by a unit test) and the worker services call them on the engine thread
through ``services.engine.commands``; they are grouped by the side of the handoff:

- sending (prefill worker): ``make_request(..., hold_kv=True)`` -> the engine computes the
  prompt, samples the first token and *holds* the blocks -> the transport writes them into the
  decode worker's reservation -> ``release(request_id)``;
- receiving (decode worker): ``make_request`` + ``reserve(request)`` -> the request waits for
  its KV in reserved blocks -> ``finish_remote_prefill(...)`` once the write landed, or
  ``prefill_locally(request_id)`` when it will not (kv failure policy ``recompute``).

Types are the engine's (``Request``, ``SamplingParams``, ``TokenLogprobs``, ``RequestOutput``),
left as ``Any`` here: kv_transfer does not import the engine (docs/architecture.md).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EngineKVHooks(Protocol):
    """An engine's part in a KV handoff. Every hook runs on the engine thread."""

    # ---- sending side (prefill worker) ------------------------------------------------------

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: Any,
                     *, hold_kv: bool = False) -> Any:
        """Build a ``Request`` (validated against the model); ``hold_kv=True``: once it finishes
        (its first token sampled), its blocks are held, not freed, until ``release``. Raises
        ValueError naming the offending field."""

    def release(self, request_id: str) -> None:
        """Free a held request's blocks: its KV has been sent (or never will be)."""

    # ---- receiving side (decode worker) -----------------------------------------------------

    def reserve(self, request: Any) -> bool:
        """Reserve blocks for the prompt's KV after the prefix this engine's prefix cache
        holds (``request.num_cached_tokens``); the request then waits for its KV. False when
        too few blocks are free (nothing reserved). Raises ValueError naming a field."""

    def finish_remote_prefill(self, request_id: str, first_token_id: int,
                              logprobs: Any = None) -> Any:
        """The prompt's KV has landed: admit the request into the running batch with its first
        token (sampled by the prefill worker, with its logprobs). The first token's
        ``RequestOutput``, or None when the request no longer waits for KV."""

    def prefill_locally(self, request_id: str) -> bool:
        """The KV will not arrive and no write into the reserved blocks is in flight: compute
        the prompt here, in those blocks. False unless the request waits for KV."""
