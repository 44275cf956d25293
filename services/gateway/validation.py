"""Public request -> (prompt token ids, SamplingParams), or ValueError naming the field."""
from __future__ import annotations

from services.api import gateway_pb2
from services.engine.sampling_params import SamplingParams
from services.engine.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 256
CHAT_ROLES = ("system", "user", "assistant")


def prompt_token_ids(req: gateway_pb2.GenerateRequest, tokenizer: Tokenizer, max_model_len: int,
                     ) -> list[int]:
    """Tokenize ``prompt`` as is, or ``messages`` through the chat template.

    Raises ValueError naming ``prompt`` or ``messages[i].role`` / ``messages[i].content``.
    """
    if req.prompt and req.messages:
        raise ValueError("prompt, messages: give exactly one of them, not both")
    if req.messages:
        for i, m in enumerate(req.messages):
            if m.role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role: {m.role!r} is not one of {', '.join(CHAT_ROLES)}")
            if not m.content:
                raise ValueError(f"messages[{i}].content: must not be empty")
        text = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in req.messages])
    elif req.prompt:
        text = req.prompt
    else:
        raise ValueError("prompt: must not be empty (or give messages)")
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError("prompt: tokenizes to no tokens")
    if len(ids) >= max_model_len:
        field = "messages" if req.messages else "prompt"
        raise ValueError(f"{field}: {len(ids)} tokens do not fit the model's context of "
                         f"{max_model_len} tokens with at least one output token")
    return ids


def sampling_params(req: gateway_pb2.GenerateRequest, num_prompt_tokens: int, max_model_len: int,
                    ) -> SamplingParams:
    """OpenAI-named options -> SamplingParams. Raises ValueError (pydantic's names the field)."""
    room = max_model_len - num_prompt_tokens
    if req.HasField("max_tokens"):
        max_tokens = req.max_tokens
        if max_tokens > room:
            raise ValueError(f"max_tokens: {max_tokens} plus the prompt's {num_prompt_tokens} "
                             f"tokens exceed the model's context of {max_model_len} tokens")
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    top_k = req.top_k if req.HasField("top_k") else 0
    if top_k == -1:
        top_k = 0
    if req.HasField("top_logprobs") and not req.logprobs:
        raise ValueError("top_logprobs: needs logprobs set to true")
    fields = {"max_tokens": max_tokens, "top_k": top_k, "ignore_eos": req.ignore_eos,
              "stop_token_ids": tuple(req.stop_token_ids), "stop": tuple(req.stop),
              "logprobs": (req.top_logprobs if req.HasField("top_logprobs") else 0) if req.logprobs else None}
    for name in _OPTIONAL_FIELDS:
        if req.HasField(name):
            fields[name] = getattr(req, name)
    return SamplingParams(**fields)


_OPTIONAL_FIELDS = ("temperature", "top_p", "seed", "min_tokens", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty")
