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

import functools
import json
from dataclasses import dataclass
from collections.abc import Callable
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.api import gateway_pb2
from services.errors import InvalidArgument
from services.gateway import tool_calls
from services.gateway.openai_responses import Presentation
from services.gateway.validation import check_structured

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


def equal_to(*values) -> Callable[[Any], bool]:
    """A ``noop`` that accepts exactly ``values`` (``False`` is not ``0``)."""
    return lambda value: any(type(value) is type(v) and value == v for v in values)


def _text_only(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(m == "text" for m in value)


_FUNCTIONS = "the deprecated function-calling fields: send tools and tool_choice instead"
_STORED = "Tandem stores no completions (OpenAI's stored-completions API)"
_END_USER = ("Tandem keeps no per-end-user accounting or abuse monitoring that an end-user "
             "identifier would feed")
# Chat and completions share these; each request class lists its own below.
_SHARED_REFUSED = {
    "user": Refused(_END_USER),
}
CHAT_REFUSED = {
    **_SHARED_REFUSED,
    "audio": Refused("the model produces text only, no audio"),
    "modalities": Refused("the model produces text only, no audio", _text_only),
    "prediction": Refused("predicted outputs are not implemented"),
    "functions": Refused(_FUNCTIONS),
    "function_call": Refused(_FUNCTIONS, equal_to("none")),
    "web_search_options": Refused("Tandem has no web search"),
    "reasoning_effort": Refused("the model does not reason before answering", equal_to("none")),
    "verbosity": Refused("the model has no verbosity control"),
    "service_tier": Refused("Tandem has one service tier (flex, scale, priority and fast do not "
                            "exist here)", equal_to("auto", "default")),
    "store": Refused(_STORED, equal_to(False)),
    "metadata": Refused(_STORED + " to attach metadata to", equal_to({})),
    "moderation": Refused("Tandem runs no moderation model"),
    "safety_identifier": Refused(_END_USER),
    "prompt_cache_key": Refused("the prefix cache is keyed by the prompt's own KV blocks; a "
                                "client-chosen cache key is not used"),
    "prompt_cache_retention": Refused("cached KV blocks live in worker memory until evicted; "
                                      "longer retention does not exist", equal_to("in_memory")),
    "prompt_cache_options": Refused("the prefix cache has no client-set options"),
}
COMPLETION_REFUSED = {
    **_SHARED_REFUSED,
    "suffix": Refused("the model does not fill in the middle (no suffix)", equal_to("")),
    "best_of": Refused("best_of > n (ranking candidates server-side) is not implemented; "
                       "best_of equal to n is accepted"),
}
# keys of a chat message or content part that Tandem refuses (message-level)
MESSAGE_REFUSED = {
    "name": Refused("the chat template has no place for a participant's name"),
    "audio": Refused("the model reads and writes text only"),
    "function_call": Refused(_FUNCTIONS),
}
REFUSED_ROLES = {"function": _FUNCTIONS}  # roles refused whole
TEXT_PART_REFUSED = {
    "prompt_cache_breakpoint": Refused("the prefix cache has no client-set breakpoints"),
}
STREAM_OPTIONS_REFUSED = {
    "include_obfuscation": Refused("Tandem does not pad stream events with random characters",
                                   equal_to(False)),
}


def refuse(fields: dict, refused: dict[str, Refused], prefix: str = "") -> None:
    """Raise ValueError ``{prefix}{name}: {reason}`` for the first of ``fields`` (present,
    non-null values) that ``refused`` lists with a value other than its no-op values."""
    for name, value in fields.items():
        rule = refused.get(name)
        if rule is not None and value is not None and not rule.noop(value):
            raise InvalidArgument(f"{prefix}{name}", rule.reason)


class OpenAIObject(BaseModel):
    """A JSON object of OpenAI's API: a null value is an absent key; unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(OpenAIObject):
    include_usage: bool = False
    include_obfuscation: Any = None  # refused (STREAM_OPTIONS_REFUSED) unless false


class ChatMessage(OpenAIObject):
    """One message of any role. ``content``: a string or a list of content parts (text;
    refusal text in an assistant's); checked by ``to_proto()``, which names the field."""

    model_config = ConfigDict(extra="allow")  # the role's own keys, checked in to_proto()
    role: str
    content: Any = None

    def to_proto(self, i: int) -> gateway_pb2.ChatMessage:
        """The gateway's message (text parts joined; an assistant's tool calls; a tool
        result's call id). Raises ValueError naming ``messages[i].*`` for a refused role, key
        or part, or a malformed content."""
        where = f"messages[{i}]"
        if self.role in REFUSED_ROLES:
            raise InvalidArgument(f"{where}.role", f"{self.role!r} messages belong to "
                                  f"{REFUSED_ROLES[self.role]}")
        extra = self.model_extra or {}
        allowed = ({"name"} | ({"refusal", "audio", "tool_calls", "function_call"}
                               if self.role == "assistant" else set())
                   | ({"tool_call_id"} if self.role == "tool" else set()))
        for key in extra:
            if key not in allowed:
                at = f".{key}" if key.isidentifier() else f"[{key!r}]"
                raise InvalidArgument(f"{where}{at}", f"unrecognized for role {self.role!r}")
        refuse(extra, MESSAGE_REFUSED, where + ".")
        refusal = extra.get("refusal")
        if refusal is not None and not isinstance(refusal, str):
            raise InvalidArgument(f"{where}.refusal", "must be a string")
        calls = _tool_calls(extra.get("tool_calls"), where + ".tool_calls")
        call_id = extra.get("tool_call_id")
        if self.role == "tool" and not isinstance(call_id, str):
            raise InvalidArgument(f"{where}.tool_call_id", "required for role 'tool' (a string)")
        if self.content is None:
            if self.role != "assistant":
                raise InvalidArgument(f"{where}.content", f"required for role {self.role!r}")
            text = refusal or ""
        else:
            text = _content_text(self.content, self.role, where + ".content") + (refusal or "")
        return gateway_pb2.ChatMessage(role=self.role, content=text, tool_calls=calls,
                                       tool_call_id=call_id or "")


def _tool_calls(calls: Any, where: str) -> list[gateway_pb2.ToolCall]:
    """An assistant message's ``tool_calls`` (function calls) as the gateway's. Raises
    ValueError naming ``{where}[j]...``."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise InvalidArgument(where, "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or call.get("type") != "function":
            raise InvalidArgument(f"{at}.type", "only function calls are accepted (type 'function')")
        fn = call.get("function")
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments"), str) and isinstance(call.get("id"), str)):
            raise InvalidArgument(at, "needs an id and a function with a name and arguments "
                                  "(JSON text)")
        out.append(gateway_pb2.ToolCall(id=call["id"], name=fn["name"], arguments=fn["arguments"]))
    return out


def _content_text(content: Any, role: str, where: str) -> str:
    """A message's content (a string, or a non-empty list of parts) as text. Raises ValueError
    naming the part (``messages[0].content[1].type``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise InvalidArgument(where, "must be a string or a non-empty list of content parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise InvalidArgument(at, "must be an object with a type")
        kind = part.get("type")
        key = "refusal" if kind == "refusal" and role == "assistant" else "text" if kind == "text" else None
        if key is None:
            raise InvalidArgument(f"{at}.type", f"{kind!r} parts are not accepted here: the model reads "
                                  "text only (text parts; refusal parts in an assistant's message)")
        rest = {k: v for k, v in part.items() if k not in ("type", key)}
        if kind == "text":
            refuse(rest, TEXT_PART_REFUSED, at + ".")
        unknown = [k for k, v in rest.items() if v is not None and k not in TEXT_PART_REFUSED]
        if unknown:
            raise InvalidArgument(f"{at}.{unknown[0]}", f"unrecognized in a {kind} part")
        if not isinstance(part.get(key), str):
            raise InvalidArgument(f"{at}.{key}", "must be a string")
        texts.append(part[key])
    return "".join(texts)


class _Common(OpenAIObject):
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
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    user: Any = None  # refused by refuse (REFUSED)
    # vLLM's extra body fields
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int32 | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**32)]] = Field(default_factory=list)
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice or grammar
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's

    REFUSED: ClassVar[dict[str, Refused]] = {}  # field -> why it is refused

    def check_n(self, max_n: int, num_prompts: int = 1) -> None:
        """Raises ValueError naming ``n`` when the request's choices (n per prompt) exceed
        ``max_n`` (setting max_n)."""
        if self.n * num_prompts > max_n:
            what = f"{self.n} choices" if num_prompts == 1 else f"{num_prompts} prompts x {self.n} choices"
            raise InvalidArgument("n", f"{what} exceed the gateway's limit of {max_n} choices per request "
                                  "(setting max_n)")

    def check_refused(self, accepted: tuple[str, ...] = ()) -> None:
        """Raises ValueError naming the first field (but ``accepted``) set to something Tandem
        does not do."""
        refuse({name: getattr(self, name) for name in self.model_fields_set
                 if name not in accepted}, self.REFUSED)
        if self.stream_options is not None:
            refuse({"include_obfuscation": self.stream_options.include_obfuscation},
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
        if self.logit_bias:
            fields["logit_bias"] = _logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            fields["structured_outputs"] = _structured_outputs(self.structured_outputs)
        if self.prompt_logprobs is not None:
            fields["prompt_logprobs"] = self.prompt_logprobs
        return {**fields, "model": self.model or "", "stop": stop, "ignore_eos": self.ignore_eos,
                "stop_token_ids": self.stop_token_ids}


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON keys) by id; the values' range and the ids'
    vocabulary are checked by the gateway (``validation.logit_bias``). Raises ValueError naming
    ``logit_bias``."""
    out = {}
    for key, value in bias.items():
        if not key.isdigit() or int(key) >= 2**32:
            raise InvalidArgument("logit_bias", f"{key!r} is not a token id (keys are token ids, as "
                                  "strings of digits)")
        out[int(key)] = value
    return out


def _structured_outputs(so: dict[str, Any]) -> gateway_pb2.StructuredOutputs:
    """vLLM's ``structured_outputs`` (exactly one of ``json``: a schema, as an object or JSON
    text; ``regex``; ``choice``: a list of strings; ``grammar``: Lark or GBNF; or
    ``json_object: true``). Raises ValueError naming ``structured_outputs.KEY``."""
    known = ("json", "regex", "choice", "grammar", "json_object")
    for key in so:
        if key not in known:
            raise InvalidArgument(f"structured_outputs.{key}", "not supported (Tandem takes one of "
                                  f"{', '.join(known)})")
    given = [k for k, v in so.items() if v is not None and v is not False]
    if len(given) != 1:
        raise InvalidArgument("structured_outputs", f"give exactly one of {', '.join(known)}")
    kind, value = given[0], so[given[0]]
    where = f"structured_outputs.{kind}"
    if kind in ("json", "json_object"):
        schema = tool_calls.JSON_OBJECT if kind == "json_object" else _schema(value, where)
        spec = tool_calls.json_schema_spec(schema)
        check_structured("json", spec, where)
        return gateway_pb2.StructuredOutputs(json=spec)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise InvalidArgument(where, "must be a non-empty list of strings")
        return gateway_pb2.StructuredOutputs(choice=value)
    if not isinstance(value, str) or not value:
        raise InvalidArgument(where, "must be a non-empty string")
    check_structured(kind, value, where)
    return gateway_pb2.StructuredOutputs(**{kind: value})


def _schema(value: Any, where: str) -> dict:
    """A JSON schema given as an object, or as JSON text (vLLM takes both). Raises
    ValueError naming ``where``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidArgument(where, f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise InvalidArgument(where, "a JSON schema must be an object")
    return value


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
            raise InvalidArgument("messages", "must not be empty")
        messages = [m.to_proto(i) for i, m in enumerate(self.messages)]
        fields = self._common_fields()
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        if self.top_logprobs is not None:
            fields["top_logprobs"] = self.top_logprobs
        tools = self.function_tools()
        constraint = self._constraint(tools)
        if constraint is not None:
            if "structured_outputs" in fields:
                raise InvalidArgument("structured_outputs", "cannot be combined with "
                                      f"{'response_format' if self.response_format else 'tool_choice'}")
            fields["structured_outputs"] = constraint
        return [gateway_pb2.GenerateRequest(
            request_id=request_id, logprobs=self.logprobs, messages=messages,
            tools=[gateway_pb2.Tool(name=t["function"]["name"],
                                    description=t["function"].get("description") or "",
                                    parameters=json.dumps(t["function"].get("parameters") or tool_calls.JSON_OBJECT))
                   for t in tools], **fields)]

    def presentation(self, decode: Callable[[list[int]], str]) -> Presentation:
        """What the responses show beyond text: tool calls read out of the output (unless
        ``tool_choice`` is none), vLLM's ``prompt_logprobs``."""
        mode, named = self.tool_choice_mode()
        parser = None if mode == "none" else functools.partial(tool_calls.parser_for, mode, named)
        return Presentation(prompt_logprobs=self.prompt_logprobs is not None, tool_parser=parser)

    def function_tools(self) -> list[dict]:
        """``tools`` checked: function tools only, distinct names, parameter schemas that
        compile. Raises ValueError naming ``tools[i]...``."""
        if self.tools is None:
            return []
        if not isinstance(self.tools, list):
            raise InvalidArgument("tools", "must be a list of tools")
        names = set()
        for i, tool in enumerate(self.tools):
            at = f"tools[{i}]"
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise InvalidArgument(f"{at}.type", "only function tools are supported (type 'function')")
            fn = tool.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise InvalidArgument(f"{at}.function.name", "required (a non-empty string)")
            unknown = set(fn) - {"name", "description", "parameters", "strict"}
            if unknown:
                raise InvalidArgument(f"{at}.function.{sorted(unknown)[0]}", "unrecognized")
            if fn["name"] in names:
                raise InvalidArgument(f"{at}.function.name", f"{fn['name']!r} is given twice")
            names.add(fn["name"])
            if fn.get("parameters") is not None:
                params = _schema(fn["parameters"], f"{at}.function.parameters")
                check_structured("json", tool_calls.json_schema_spec(params), f"{at}.function.parameters")
        return self.tools

    def tool_choice_mode(self) -> tuple[str, str | None]:
        """(``none``, ``auto`` or ``required``, the function named or None). Raises ValueError
        naming ``tool_choice``."""
        choice = self.tool_choice
        tools = self.tools or []
        if choice is None:
            return ("auto" if tools else "none"), None
        if isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                raise InvalidArgument("tool_choice",
                                      f"{choice!r} is not none, auto, required or a named function")
            if choice != "none" and not tools:
                raise InvalidArgument("tool_choice", f"{choice!r} needs tools")
            return choice, None
        fn = choice.get("function") if isinstance(choice, dict) else None
        if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str)):
            raise InvalidArgument("tool_choice", "must be none, auto, required or {\"type\": \"function\", "
                                  "\"function\": {\"name\": ...}}")
        if fn["name"] not in {t["function"]["name"] for t in tools}:
            raise InvalidArgument("tool_choice.function.name", f"{fn['name']!r} is not one of the tools")
        return "required", fn["name"]

    def _constraint(self, tools: list[dict]) -> gateway_pb2.StructuredOutputs | None:
        """The output's constraint from ``response_format`` or ``tool_choice`` (required, or a
        named function: held to a JSON schema of the call). Raises ValueError naming them."""
        fmt = response_format_constraint(self.response_format)
        mode, named = self.tool_choice_mode()
        if mode != "required":
            return fmt
        if fmt is not None:
            raise InvalidArgument("tool_choice", "a required or named tool call cannot be combined with "
                                  "response_format")
        if named is not None:
            fn = next(t["function"] for t in tools if t["function"]["name"] == named)
            schema = _schema(fn.get("parameters") or tool_calls.JSON_OBJECT, "tools")
        else:
            schema = tool_calls.required_schema(tools, self.parallel_tool_calls)
        return gateway_pb2.StructuredOutputs(json=tool_calls.json_schema_spec(schema))


def response_format_constraint(fmt: Any) -> gateway_pb2.StructuredOutputs | None:
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object), ``json_schema`` (``json_schema.schema``; ``strict`` or not, the output is held to
    it). Raises ValueError naming ``response_format...``."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return gateway_pb2.StructuredOutputs(json=tool_calls.json_schema_spec(tool_calls.JSON_OBJECT))
    if kind != "json_schema":
        raise InvalidArgument("response_format.type", f"{kind!r} is not text, json_object or json_schema")
    js = fmt.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str):
        raise InvalidArgument("response_format.json_schema", "needs a name and a schema")
    unknown = set(js) - {"name", "description", "schema", "strict"}
    if unknown:
        raise InvalidArgument(f"response_format.json_schema.{sorted(unknown)[0]}", "unrecognized")
    if js.get("strict") not in (None, True, False):
        raise InvalidArgument("response_format.json_schema.strict", "must be a boolean")
    where = "response_format.json_schema.schema"
    spec = tool_calls.json_schema_spec(_schema(js.get("schema", tool_calls.JSON_OBJECT), where))
    check_structured("json", spec, where)
    return gateway_pb2.StructuredOutputs(json=spec)


class CompletionRequest(_Common):
    """``prompt`` in its four forms: a string, a list of strings (a batch: n choices per
    prompt), a list of token ids, a list of token-id lists (a batch)."""

    REFUSED: ClassVar[dict[str, Refused]] = COMPLETION_REFUSED

    prompt: Any = DEFAULT_PROMPT  # checked by prompts(): the four forms have clean errors
    max_tokens: Int32 | None = None  # absent: DEFAULT_MAX_TOKENS
    logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's max; OpenAI's is 5
    echo: bool = False  # the prompt before the choice's text (and its logprobs, with logprobs)
    suffix: Any = None
    best_of: Any = None

    def prompts(self) -> list[str | list[int]]:
        """The batch's prompts in order: strings or token-id lists. Raises ValueError naming
        ``prompt`` or ``prompt[i]`` / ``prompt[i][j]``."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not isinstance(p, list) or not p:
            raise InvalidArgument("prompt", "must be a string, or a non-empty list of strings, of token "
                                  "ids, or of token-id lists")
        if all(_is_token_id(t) for t in p):
            return [p]
        if all(isinstance(s, str) for s in p):
            return list(p)
        for i, ids in enumerate(p):
            if not isinstance(ids, list) or not ids:
                raise InvalidArgument(f"prompt[{i}]", "a list prompt holds strings, token ids or non-empty "
                                      "token-id lists, one kind throughout")
            for j, t in enumerate(ids):
                if not _is_token_id(t):
                    raise InvalidArgument(f"prompt[{i}][{j}]", "must be a token id (an integer >= 0)")
        return list(p)

    def presentation(self, decode: Callable[[list[int]], str]) -> Presentation:
        """What the responses show beyond text: with ``echo``, each prompt's text (token-id
        prompts through ``decode``) and, with ``logprobs``, its tokens' logprobs; vLLM's
        ``prompt_logprobs``."""
        echo = ([p if isinstance(p, str) else decode(p) for p in self.prompts()]
                if self.echo else None)
        return Presentation(echo=echo, echo_logprobs=self.echo and self.logprobs is not None,
                            prompt_logprobs=self.prompt_logprobs is not None)

    def check_refused(self, accepted: tuple[str, ...] = ()) -> None:
        """As ``_Common``'s; ``best_of`` equal to ``n`` asks for nothing more than n choices."""
        best_of = self.best_of
        if type(best_of) is int and best_of < self.n:
            raise InvalidArgument("best_of", f"{best_of} is less than n ({self.n}); it must be at least n")
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
        if self.echo and (self.logprobs is not None or fields.get("max_tokens") == 0):
            # the prompt's logprobs to echo (max_tokens 0: the prompt is only scored)
            fields["prompt_logprobs"] = max(self.logprobs or 0, fields.get("prompt_logprobs", 0))
        return [gateway_pb2.GenerateRequest(request_id=request_id, **fields, **(
            {"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}))
            for p in self.prompts()]


def _is_token_id(t: Any) -> bool:
    return type(t) is int and 0 <= t < 2**32
