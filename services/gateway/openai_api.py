"""OpenAI's HTTP request bodies (``CreateChatCompletionRequest``, ``CreateCompletionRequest``
of OpenAI's OpenAPI document, vendored in ``tests/contract/openai-openapi.yaml``), translated
to the gateway's own ``GenerateRequest``: the HTTP front end parses the JSON here and then
calls the same pipeline as gRPC. Responses are ``openai_responses.py``.

The rules, from the specification and from OpenAI's server:
- ``null`` means absent (the specification marks most optional fields nullable; clients that
  serialise typed requests send every unset field as null).
- Every field of the specification is either honoured or, where Tandem does not do what it
  asks, refused with 400 naming it (``REFUSED``: field -> reason, and the values that ask for
  nothing, such as ``store: false`` or ``tools: []``, which are accepted). A key that is in
  neither the specification nor vLLM's extra fields (``top_k``, ``min_p``,
  ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``) is refused, as
  OpenAI's server refuses an unrecognized argument.
- Types are strict (``"1"`` is not an integer); ranges follow the specification where the
  engine can honour the whole range: a negative ``seed`` is taken modulo 2**63, ``top_p: 0``
  keeps the most likely token only (``top_k`` 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.api import gateway_pb2

Int32 = Annotated[int, Field(ge=-2**31, le=2**31 - 1)]  # the gateway proto's int32 fields
SEED_MODULUS = 2**63  # SamplingParams' seed range; OpenAI's seeds are any int64
# CreateCompletionRequest's ``prompt`` when absent: generate as from the start of a document
DEFAULT_PROMPT = "<|endoftext|>"
DEFAULT_MAX_TOKENS = 16  # CreateCompletionRequest's ``max_tokens`` when absent


@dataclass(frozen=True)
class Refused:
    """A field of OpenAI's specification that Tandem does not honour: any value but ``noop``
    (values that ask for nothing; a predicate) is refused with 400 ``{field}: {reason}``."""

    reason: str
    noop: Callable[[Any], bool] = lambda value: False


def _equal_to(*values) -> Callable[[Any], bool]:
    """A ``noop`` that accepts exactly ``values`` (``False`` is not ``0``)."""
    return lambda value: any(type(value) is type(v) and value == v for v in values)


def _text_only(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(m == "text" for m in value)


_TOOLS = "tool and function calling is not implemented yet"
_STORED = "Tandem stores no completions (OpenAI's stored-completions API)"
_END_USER = ("Tandem keeps no per-end-user accounting or abuse monitoring that an end-user "
             "identifier would feed")
# Chat and completions share these; each request class lists its own below.
_SHARED_REFUSED = {
    "logit_bias": Refused("logit_bias is not implemented yet", _equal_to({})),
    "user": Refused(_END_USER),
}
CHAT_REFUSED = {
    **_SHARED_REFUSED,
    "audio": Refused("the model produces text only, no audio"),
    "modalities": Refused("the model produces text only, no audio", _text_only),
    "prediction": Refused("predicted outputs are not implemented"),
    "response_format": Refused("structured outputs (json_schema, json_object) are not "
                               "implemented yet", _equal_to({"type": "text"})),
    "tools": Refused(_TOOLS, _equal_to([])),
    "tool_choice": Refused(_TOOLS, _equal_to("none")),
    "functions": Refused(_TOOLS),
    "function_call": Refused(_TOOLS, _equal_to("none")),
    "web_search_options": Refused("Tandem has no web search"),
    "reasoning_effort": Refused("the model does not reason before answering", _equal_to("none")),
    "verbosity": Refused("the model has no verbosity control"),
    "service_tier": Refused("Tandem has one service tier (flex, scale, priority and fast do not "
                            "exist here)", _equal_to("auto", "default")),
    "store": Refused(_STORED, _equal_to(False)),
    "metadata": Refused(_STORED + " to attach metadata to", _equal_to({})),
    "moderation": Refused("Tandem runs no moderation model"),
    "safety_identifier": Refused(_END_USER),
    "prompt_cache_key": Refused("the prefix cache is keyed by the prompt's own KV blocks; a "
                                "client-chosen cache key is not used"),
    "prompt_cache_retention": Refused("cached KV blocks live in worker memory until evicted; "
                                      "longer retention does not exist", _equal_to("in_memory")),
    "prompt_cache_options": Refused("the prefix cache has no client-set options"),
}
COMPLETION_REFUSED = {
    **_SHARED_REFUSED,
    "echo": Refused("echoing the prompt (with its logprobs) is not implemented yet", _equal_to(False)),
    "suffix": Refused("the model does not fill in the middle (no suffix)", _equal_to("")),
    "best_of": Refused("best_of > n (ranking candidates server-side) is not implemented; "
                       "best_of equal to n is accepted"),
}
# keys of a chat message or content part that Tandem refuses (message-level)
MESSAGE_REFUSED = {
    "name": Refused("the chat template has no place for a participant's name"),
    "audio": Refused("the model reads and writes text only"),
    "tool_calls": Refused(_TOOLS, _equal_to([])),
    "function_call": Refused(_TOOLS),
}
TOOL_ROLES = ("tool", "function")  # roles of tool calling, refused with _TOOLS
TEXT_PART_REFUSED = {
    "prompt_cache_breakpoint": Refused("the prefix cache has no client-set breakpoints"),
}
STREAM_OPTIONS_REFUSED = {
    "include_obfuscation": Refused("Tandem does not pad stream events with random characters",
                                   _equal_to(False)),
}


def _refuse(fields: dict, refused: dict[str, Refused], prefix: str = "") -> None:
    """Raise ValueError ``{prefix}{name}: {reason}`` for the first of ``fields`` (present,
    non-null values) that ``refused`` lists with a value other than its no-op values."""
    for name, value in fields.items():
        rule = refused.get(name)
        if rule is not None and value is not None and not rule.noop(value):
            raise ValueError(f"{prefix}{name}: {rule.reason}")


class _Object(BaseModel):
    """A JSON object of OpenAI's API: a null value is an absent key; unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Object):
    include_usage: bool = False
    include_obfuscation: Any = None  # refused (STREAM_OPTIONS_REFUSED) unless false


class ChatMessage(_Object):
    """One message of any role. ``content``: a string or a list of content parts (text;
    refusal text in an assistant's); checked by ``text()``, which names the field."""

    model_config = ConfigDict(extra="allow")  # the role's own keys, checked in text()
    role: str
    content: Any = None

    def text(self, i: int) -> str:
        """The message's text for the chat template (text parts joined). Raises ValueError
        naming ``messages[i].*`` for a refused role, key or part, or a malformed content."""
        where = f"messages[{i}]"
        if self.role in TOOL_ROLES:
            raise ValueError(f"{where}.role: {self.role!r} messages belong to tool calling, "
                             "which is not implemented yet")
        extra = self.model_extra or {}
        allowed = {"name"} | ({"refusal", "audio", "tool_calls", "function_call"}
                              if self.role == "assistant" else set())
        for key in extra:
            if key not in allowed:
                at = f".{key}" if key.isidentifier() else f"[{key!r}]"
                raise ValueError(f"{where}{at}: unrecognized for role {self.role!r}")
        _refuse(extra, MESSAGE_REFUSED, where + ".")
        refusal = extra.get("refusal")
        if refusal is not None and not isinstance(refusal, str):
            raise ValueError(f"{where}.refusal: must be a string")
        if self.content is None:
            if self.role != "assistant":
                raise ValueError(f"{where}.content: required for role {self.role!r}")
            return refusal or ""
        return _content_text(self.content, self.role, where + ".content") + (refusal or "")


def _content_text(content: Any, role: str, where: str) -> str:
    """A message's content (a string, or a non-empty list of parts) as text. Raises ValueError
    naming the part (``messages[0].content[1].type``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ValueError(f"{where}: must be a string or a non-empty list of content parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise ValueError(f"{at}: must be an object with a type")
        kind = part.get("type")
        key = "refusal" if kind == "refusal" and role == "assistant" else "text" if kind == "text" else None
        if key is None:
            raise ValueError(f"{at}.type: {kind!r} parts are not accepted here: the model reads "
                             "text only (text parts; refusal parts in an assistant's message)")
        rest = {k: v for k, v in part.items() if k not in ("type", key)}
        if kind == "text":
            _refuse(rest, TEXT_PART_REFUSED, at + ".")
        unknown = [k for k, v in rest.items() if v is not None and k not in TEXT_PART_REFUSED]
        if unknown:
            raise ValueError(f"{at}.{unknown[0]}: unrecognized in a {kind} part")
        if not isinstance(part.get(key), str):
            raise ValueError(f"{at}.{key}: must be a string")
        texts.append(part[key])
    return "".join(texts)


class _Common(_Object):
    """The fields chat and completions share: OpenAI's sampling options, ``n``, streaming, and
    vLLM's extra body fields."""

    model: str | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=128)  # choices; at most the gateway's max_n (check_n)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-2**63, lt=2**64)  # taken modulo 2**63
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # accepted in either shape of the specification, refused by _refuse unless a no-op
    logit_bias: Any = None
    user: Any = None
    # vLLM's extra body fields
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int32 | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**32)]] = Field(default_factory=list)

    REFUSED: ClassVar[dict[str, Refused]] = {}  # field -> why it is refused

    def check_n(self, max_n: int, num_prompts: int = 1) -> None:
        """Raises ValueError naming ``n`` when the request's choices (n per prompt) exceed
        ``max_n`` (setting max_n)."""
        if self.n * num_prompts > max_n:
            what = f"{self.n} choices" if num_prompts == 1 else f"{num_prompts} prompts x {self.n} choices"
            raise ValueError(f"n: {what} exceed the gateway's limit of {max_n} choices per request "
                             "(setting max_n)")

    def check_refused(self, accepted: tuple[str, ...] = ()) -> None:
        """Raises ValueError naming the first field (but ``accepted``) set to something Tandem
        does not do."""
        _refuse({name: getattr(self, name) for name in self.model_fields_set
                 if name not in accepted}, self.REFUSED)
        if self.stream_options is not None:
            _refuse({"include_obfuscation": self.stream_options.include_obfuscation},
                    STREAM_OPTIONS_REFUSED, "stream_options.")

    def _common_fields(self) -> dict:
        fields = {name: getattr(self, name) for name in (
            "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
            "min_p", "repetition_penalty", "min_tokens") if getattr(self, name) is not None}
        if self.seed is not None:
            fields["seed"] = self.seed % SEED_MODULUS
        if self.top_p == 0:  # the nucleus of mass 0 is the most likely token alone
            del fields["top_p"]
            fields["top_k"] = 1
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {**fields, "model": self.model or "", "stop": stop, "ignore_eos": self.ignore_eos,
                "stop_token_ids": self.stop_token_ids}


class ChatCompletionRequest(_Common):
    REFUSED: ClassVar[dict[str, Refused]] = CHAT_REFUSED

    messages: list[ChatMessage]
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    parallel_tool_calls: bool = True  # honoured: without tools there is nothing to parallelise
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None
    moderation: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None

    def to_protos(self, request_id: str, max_tokens_cap: int | None = None,
                  ) -> list[gateway_pb2.GenerateRequest]:
        """The gateway request (one: a chat has one prompt; without a max_tokens, the gateway's
        default applies, bounded by ``max_tokens_cap``). Raises ValueError naming the field."""
        self.check_refused()
        if not self.messages:
            raise ValueError("messages: must not be empty")
        messages = [gateway_pb2.ChatMessage(role=m.role, content=m.text(i))
                    for i, m in enumerate(self.messages)]
        fields = self._common_fields()
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        if self.top_logprobs is not None:
            fields["top_logprobs"] = self.top_logprobs
        return [gateway_pb2.GenerateRequest(request_id=request_id, logprobs=self.logprobs,
                                            messages=messages, **fields)]


class CompletionRequest(_Common):
    """``prompt`` in its four forms: a string, a list of strings (a batch: n choices per
    prompt), a list of token ids, a list of token-id lists (a batch)."""

    REFUSED: ClassVar[dict[str, Refused]] = COMPLETION_REFUSED

    prompt: Any = DEFAULT_PROMPT  # checked by prompts(): the four forms have clean errors
    max_tokens: Int32 | None = None  # absent: DEFAULT_MAX_TOKENS
    logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's max; OpenAI's is 5
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    def prompts(self) -> list[str | list[int]]:
        """The batch's prompts in order: strings or token-id lists. Raises ValueError naming
        ``prompt`` or ``prompt[i]`` / ``prompt[i][j]``."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not isinstance(p, list) or not p:
            raise ValueError("prompt: must be a string, or a non-empty list of strings, of token "
                             "ids, or of token-id lists")
        if all(_is_token_id(t) for t in p):
            return [p]
        if all(isinstance(s, str) for s in p):
            return list(p)
        for i, ids in enumerate(p):
            if not isinstance(ids, list) or not ids:
                raise ValueError(f"prompt[{i}]: a list prompt holds strings, token ids or non-empty "
                                 "token-id lists, one kind throughout")
            for j, t in enumerate(ids):
                if not _is_token_id(t):
                    raise ValueError(f"prompt[{i}][{j}]: must be a token id (an integer >= 0)")
        return list(p)

    def check_refused(self, accepted: tuple[str, ...] = ()) -> None:
        """As ``_Common``'s; ``best_of`` equal to ``n`` asks for nothing more than n choices."""
        best_of = self.best_of
        if type(best_of) is int and best_of < self.n:
            raise ValueError(f"best_of: {best_of} is less than n ({self.n}); it must be at least n")
        super().check_refused(accepted + (("best_of",) if type(best_of) is int and best_of == self.n else ()))

    def to_protos(self, request_id: str, max_tokens_cap: int | None = None,
                  ) -> list[gateway_pb2.GenerateRequest]:
        """One gateway request per prompt, in order; without ``max_tokens``, OpenAI's default
        of 16 bounded by ``max_tokens_cap`` (setting max_tokens_cap). Raises ValueError naming
        the field."""
        self.check_refused()
        fields = self._common_fields()
        if "max_tokens" not in self.model_fields_set:
            fields["max_tokens"] = min(DEFAULT_MAX_TOKENS, max_tokens_cap or DEFAULT_MAX_TOKENS)
        elif self.max_tokens is not None:
            fields["max_tokens"] = self.max_tokens
        if self.logprobs is not None:
            fields.update(logprobs=True, top_logprobs=self.logprobs)
        return [gateway_pb2.GenerateRequest(request_id=request_id, **fields, **(
            {"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}))
            for p in self.prompts()]


def _is_token_id(t: Any) -> bool:
    return type(t) is int and 0 <= t < 2**32
