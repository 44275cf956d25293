"""Public request -> (prompt token ids, SamplingParams), or ValueError naming the field.

Checks that cost nothing run first (``check_request``: counts, finite floats); rendering the
chat template and tokenizing (``prompt_token_ids``) are CPU work the caller runs off its event
loop; ``sampling_params`` then checks the options against the prompt and the model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pydantic

from services.api import gateway_pb2
from services.engine.sampling_params import SamplingParams
from services.engine.tokenizer import Tokenizer
from services.gateway.model_card import ModelCard
from services.rpc import validation_message

DEFAULT_MAX_TOKENS = 256
# "developer" is OpenAI's newer name for the instructions ("system") role
CHAT_ROLES = ("developer", "system", "user", "assistant")
# vLLM's _SAMPLING_EPS: a temperature below it divides logits into overflow; it means greedy.
GREEDY_TEMPERATURE_EPS = 1e-5
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
_OPTIONAL_FIELDS = ("temperature", "top_p", "seed", "min_tokens", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty")
# SamplingParams field -> the request field a client set it with (for error messages)
_REQUEST_NAMES = {"logprobs": "top_logprobs"}


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the gateway (each a setting: see the lead's settings tree)."""

    max_request_bytes: int = 4 * 1024 * 1024  # serialized request, checked before parsing
    max_messages: int = 256  # chat messages in one request
    max_tokens_cap: int | None = None  # output tokens one request may ask for; None: the context
    max_n: int = 16  # choices one HTTP request may ask for (``n``)


def check_request(req: gateway_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """Cheap checks before any CPU work: one of prompt/messages/prompt_token_ids, their count,
    finite floats.

    Raises ValueError naming ``prompt``, ``messages``, ``prompt_token_ids`` or the float field."""
    given = [name for name in ("prompt", "messages", "prompt_token_ids") if getattr(req, name)]
    if len(given) > 1:
        raise ValueError(f"{', '.join(given)}: give exactly one of them")
    if not given:
        raise ValueError("prompt: must not be empty (or give messages or prompt_token_ids)")
    if len(req.messages) > limits.max_messages:
        raise ValueError(f"messages: {len(req.messages)} messages exceed the limit of "
                         f"{limits.max_messages} (setting max_messages)")
    cap = limits.max_tokens_cap
    if cap is not None and req.HasField("max_tokens") and req.max_tokens > cap:
        raise ValueError(f"max_tokens: {req.max_tokens} exceeds the gateway's limit of {cap} "
                         "(setting max_tokens_cap)")
    for name in _FLOAT_FIELDS:
        if req.HasField(name) and not math.isfinite(getattr(req, name)):
            raise ValueError(f"{name}: must be a finite number, got {getattr(req, name)}")


def prompt_token_ids(req: gateway_pb2.GenerateRequest, tokenizer: Tokenizer, max_model_len: int,
                     ) -> list[int]:
    """Tokenize ``prompt`` as is, or ``messages`` through the chat template, or check
    ``prompt_token_ids`` against the vocabulary. CPU-bound (a long prompt takes seconds): call
    it off the event loop.

    Raises ValueError naming ``prompt``, ``messages``, ``messages[i].role``, or
    ``prompt_token_ids`` / ``prompt_token_ids[i]``.
    """
    field = "messages" if req.messages else "prompt_token_ids" if req.prompt_token_ids else "prompt"
    if req.messages:
        ids = tokenizer.encode(tokenizer.apply_chat_template(template_messages(req.messages, tokenizer)))
    elif req.prompt_token_ids:
        ids = list(req.prompt_token_ids)
        for i, token_id in enumerate(ids):
            if token_id >= tokenizer.vocab_size:
                raise ValueError(f"prompt_token_ids[{i}]: {token_id} is not a token id of the model "
                                 f"(ids are 0 to {tokenizer.vocab_size - 1})")
    elif req.prompt:
        ids = tokenizer.encode(req.prompt)
    else:
        raise ValueError("prompt: must not be empty (or give messages or prompt_token_ids)")
    if not ids:
        raise ValueError("prompt: tokenizes to no tokens")
    if len(ids) >= max_model_len:
        raise ValueError(f"{field}: {len(ids)} tokens do not fit the model's context of "
                         f"{max_model_len} tokens with at least one output token")
    return ids


def template_messages(messages, tokenizer: Tokenizer) -> list[dict[str, str]]:
    """``messages`` as the chat template's ``{role, content}`` dicts. ``developer`` (OpenAI's
    newer name for the instructions role) becomes ``system`` unless the template itself knows
    the developer role (as gpt-oss's does); ChatML and Llama templates know only ``system``.

    Raises ValueError naming ``messages[i].role``."""
    knows_developer = "developer" in (tokenizer.chat_template or "")
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role: {m.role!r} is not one of {', '.join(CHAT_ROLES)}")
        role = "system" if m.role == "developer" and not knows_developer else m.role
        out.append({"role": role, "content": m.content})
    return out


def sampling_params(req: gateway_pb2.GenerateRequest, num_prompt_tokens: int, model: ModelCard,
                    max_tokens_cap: int | None = None) -> SamplingParams:
    """OpenAI-named options -> SamplingParams. Raises ValueError naming the request's field.

    A temperature below ``GREEDY_TEMPERATURE_EPS`` is greedy (0), as in vLLM. Without
    ``max_tokens``, a request gets ``DEFAULT_MAX_TOKENS``, bounded by the context left after
    the prompt and by ``max_tokens_cap``."""
    room = model.max_model_len - num_prompt_tokens
    if req.HasField("max_tokens"):
        max_tokens = req.max_tokens
        if max_tokens > room:
            raise ValueError(f"max_tokens: {max_tokens} plus the prompt's {num_prompt_tokens} "
                             f"tokens exceed the model's context of {model.max_model_len} tokens")
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, room, max_tokens_cap or room)
    top_k = req.top_k if req.HasField("top_k") else 0
    if top_k == -1:
        top_k = 0
    if req.HasField("top_logprobs") and not req.logprobs:
        raise ValueError("top_logprobs: needs logprobs set to true")
    for i, token_id in enumerate(req.stop_token_ids):
        if token_id >= model.vocab_size:
            raise ValueError(f"stop_token_ids[{i}]: {token_id} is not a token id of the model "
                             f"(ids are 0 to {model.vocab_size - 1})")
    fields = {"max_tokens": max_tokens, "top_k": top_k, "ignore_eos": req.ignore_eos,
              "stop_token_ids": tuple(req.stop_token_ids), "stop": tuple(req.stop),
              "logprobs": (req.top_logprobs if req.HasField("top_logprobs") else 0) if req.logprobs else None}
    for name in _OPTIONAL_FIELDS:
        if req.HasField(name):
            fields[name] = getattr(req, name)
    if 0.0 <= fields.get("temperature", 1.0) < GREEDY_TEMPERATURE_EPS:
        fields["temperature"] = 0.0
    try:
        return SamplingParams(**fields)
    except pydantic.ValidationError as exc:
        raise ValueError(_request_named(exc)) from None


def _request_named(exc: pydantic.ValidationError) -> str:
    """pydantic's message with each SamplingParams field renamed to the request's field."""
    message = validation_message(exc)
    for internal, public in _REQUEST_NAMES.items():
        if any(e["loc"][:1] == (internal,) for e in exc.errors()):
            message = message.replace(f"{internal}:", f"{public}:")
    return message
