"""Public request -> (prompt token ids, SamplingParams), or ValueError naming the field.

Checks that cost nothing run first (``check_request``: counts, finite floats); rendering the
chat template and tokenizing (``prompt_token_ids``) are CPU work the caller runs off its event
loop; ``sampling_params`` then checks the options against the prompt and the model.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pydantic

from services.api import gateway_pb2
from services.engine.grammars import grammar_of
from services.engine.sampling_params import SamplingParams, StructuredOutput
from services.engine.tokenizer import Tokenizer
from services.errors import CONTEXT_LENGTH_EXCEEDED, InvalidArgument, from_validation
from services.gateway import tool_calls
from services.gateway.model_card import ModelCard

DEFAULT_MAX_TOKENS = 256
# "developer" is OpenAI's newer name for the instructions ("system") role; "tool" answers a call
CHAT_ROLES = ("developer", "system", "user", "assistant", "tool")
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")  # StructuredOutputs' fields
MAX_LOGIT_BIAS = 100.0  # OpenAI's range of a logit_bias value: [-100, 100]
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
        raise ValueError(f"{', '.join(given)}: give exactly one of them")  # no one field at fault
    if not given:
        raise InvalidArgument("prompt", "must not be empty (or give messages or prompt_token_ids)")
    if len(req.messages) > limits.max_messages:
        raise InvalidArgument("messages", f"{len(req.messages)} messages exceed the limit of "
                              f"{limits.max_messages} (setting max_messages)")
    cap = limits.max_tokens_cap
    if cap is not None and req.HasField("max_tokens") and req.max_tokens > cap:
        raise InvalidArgument("max_tokens", f"{req.max_tokens} exceeds the gateway's limit of {cap} "
                              "(setting max_tokens_cap)")
    for name in _FLOAT_FIELDS:
        if req.HasField(name) and not math.isfinite(getattr(req, name)):
            raise InvalidArgument(name, f"must be a finite number, got {getattr(req, name)}")


def prompt_token_ids(req: gateway_pb2.GenerateRequest, tokenizer: Tokenizer, max_model_len: int,
                     ) -> list[int]:
    """Tokenize ``prompt`` as is, or ``messages`` through the chat template, or check
    ``prompt_token_ids`` against the vocabulary. CPU-bound (a long prompt takes seconds): call
    it off the event loop.

    Raises ValueError naming ``prompt``, ``messages``, ``messages[i].role``, or
    ``prompt_token_ids`` / ``prompt_token_ids[i]``.
    """
    field = "messages" if req.messages else "prompt_token_ids" if req.prompt_token_ids else "prompt"
    if req.tools and not req.messages:
        raise InvalidArgument("tools", "are shown to the model through the chat template: send messages")
    if req.messages:
        messages, tools = tool_calls.template_inputs(template_messages(req.messages, tokenizer),
                                                     list(req.tools), tokenizer.chat_template)
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools))
    elif req.prompt_token_ids:
        ids = list(req.prompt_token_ids)
        for i, token_id in enumerate(ids):
            if token_id >= tokenizer.vocab_size:
                raise InvalidArgument(f"prompt_token_ids[{i}]", f"{token_id} is not a token id of the model "
                                      f"(ids are 0 to {tokenizer.vocab_size - 1})")
    elif req.prompt:
        ids = tokenizer.encode(req.prompt)
    else:
        raise InvalidArgument("prompt", "must not be empty (or give messages or prompt_token_ids)")
    if not ids:
        raise InvalidArgument("prompt", "tokenizes to no tokens")
    if len(ids) >= max_model_len:
        raise InvalidArgument(field, f"{len(ids)} tokens do not fit the model's context of "
                              f"{max_model_len} tokens with at least one output token",
                              code=CONTEXT_LENGTH_EXCEEDED)
    return ids


def template_messages(messages, tokenizer: Tokenizer) -> list[dict]:
    """``messages`` as the chat template's ``{role, content}`` dicts (an assistant's
    ``tool_calls`` and a tool message's ``tool_call_id`` as transformers passes them, see
    ``tool_calls.template_message``). ``developer`` (OpenAI's newer name for the instructions
    role) becomes ``system`` unless the template itself knows the developer role (as gpt-oss's
    does); ChatML and Llama templates know only ``system``.

    Raises ValueError naming ``messages[i].role`` or ``messages[i].tool_calls[j]``."""
    knows_developer = "developer" in (tokenizer.chat_template or "")
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(f"messages[{i}].role", f"{m.role!r} is not one of {', '.join(CHAT_ROLES)}")
        if m.tool_calls and m.role != "assistant":
            raise InvalidArgument(f"messages[{i}].tool_calls", "only an assistant's message makes tool calls")
        role = "system" if m.role == "developer" and not knows_developer else m.role
        out.append(tool_calls.template_message(m, role, f"messages[{i}]"))
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
            raise InvalidArgument("max_tokens", f"{max_tokens} plus the prompt's {num_prompt_tokens} "
                                  f"tokens exceed the model's context of {model.max_model_len} tokens",
                                  code=CONTEXT_LENGTH_EXCEEDED)
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, room, max_tokens_cap or room)
    top_k = req.top_k if req.HasField("top_k") else 0
    if top_k == -1:
        top_k = 0
    if req.HasField("top_logprobs") and not req.logprobs:
        raise InvalidArgument("top_logprobs", "needs logprobs set to true")
    for i, token_id in enumerate(req.stop_token_ids):
        if token_id >= model.vocab_size:
            raise InvalidArgument(f"stop_token_ids[{i}]", f"{token_id} is not a token id of the model "
                                  f"(ids are 0 to {model.vocab_size - 1})")
    fields = {"max_tokens": max_tokens, "top_k": top_k, "ignore_eos": req.ignore_eos,
              "stop_token_ids": tuple(req.stop_token_ids), "stop": tuple(req.stop),
              "logprobs": (req.top_logprobs if req.HasField("top_logprobs") else 0) if req.logprobs else None,
              "structured_output": structured_output(req.structured_outputs)
              if req.HasField("structured_outputs") else None,
              "logit_bias": logit_bias(req.logit_bias, model.vocab_size)}
    if req.HasField("prompt_logprobs"):
        fields["prompt_logprobs"] = req.prompt_logprobs
    for name in _OPTIONAL_FIELDS:
        if req.HasField(name):
            fields[name] = getattr(req, name)
    if 0.0 <= fields.get("temperature", 1.0) < GREEDY_TEMPERATURE_EPS:
        fields["temperature"] = 0.0
    try:
        return SamplingParams(**fields)
    except pydantic.ValidationError as exc:
        raise from_validation(exc, _REQUEST_NAMES) from None


def structured_output(so: gateway_pb2.StructuredOutputs, field: str = "structured_outputs",
                      ) -> StructuredOutput:
    """The engine's constraint for ``structured_outputs`` (exactly one of json, regex, choice,
    grammar), compiled once here so a bad spec is refused before any worker sees it. Raises
    ValueError naming ``field`` (or ``field.KIND``) and why."""
    given = [kind for kind in STRUCTURED_KINDS if getattr(so, kind)]
    if len(given) != 1:
        raise InvalidArgument(field, f"give exactly one of {', '.join(STRUCTURED_KINDS)}"
                              + (f" (got {', '.join(given)})" if given else ""))
    kind = given[0]
    spec = json.dumps(list(so.choice)) if kind == "choice" else getattr(so, kind)
    check_structured(kind, spec, f"{field}.{kind}")
    return StructuredOutput(format=kind, spec=spec)


def check_structured(kind: str, spec: str, field: str) -> None:
    """Compile ``spec`` as a structured output of ``kind`` (json, regex, choice, grammar;
    cached: the worker's own check costs nothing more). Raises ValueError naming ``field``."""
    try:
        grammar_of(kind, spec)
    except InvalidArgument as exc:
        raise exc.renamed(field) from None


def logit_bias(bias, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (token id -> bias) checked: ids in the vocabulary, finite biases within
    [-100, 100] (OpenAI's range). Raises ValueError naming ``logit_bias`` and the id."""
    for token_id, value in sorted(bias.items()):
        if token_id >= vocab_size:
            raise InvalidArgument("logit_bias", f"{token_id} is not a token id of the model (ids are 0 "
                                  f"to {vocab_size - 1})")
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise InvalidArgument("logit_bias", f"the bias of token {token_id} must be within "
                                  f"[-100, 100], got {value}")
    return tuple(sorted(bias.items()))
