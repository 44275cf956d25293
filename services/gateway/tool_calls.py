"""Tool calling: tools shown to the model through its chat template, calls made with
``tool_choice`` ``required`` or a named function held to a JSON schema, and calls read back out
of the model's text (whole, or as a stream of deltas).

The template: when the model's chat template knows tools (it names ``tools``, as Qwen2.5's,
Hermes' and Llama 3.1's do), it gets OpenAI's tool objects as ``tools`` and the messages as
transformers passes them (an assistant's ``tool_calls`` with their arguments as objects, a
tool message's ``tool_call_id``). A template that does not (the built-in SmolLM2's ChatML) gets
them written into the messages in the Hermes / Qwen format instead: the tools' signatures in the
system message between ``<tools></tools>``, each call as ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` in the assistant's text, each result as ``<tool_response>...``
``</tool_response>`` in a user message.

The model's calls: ``auto`` reads Hermes-style ``<tool_call>`` blocks out of the text
(``HermesParser``; text outside them is the message's content). ``required`` and a named
function constrain the output instead, as vLLM does: a named call's output is its arguments, a
JSON object of the function's parameter schema (``NamedParser``); ``required``'s is a JSON
array of ``{"name", "parameters"}`` objects, one of the tools each (``ArrayParser``), at most
one when ``parallel_tool_calls`` is false.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from services.errors import InvalidArgument

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
JSON_OBJECT = {"type": "object"}
# llguidance's JSON options: no free whitespace (a small model can loop on newlines), the
# separators of Python's json.dumps
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_OPEN_OBJECT_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


@dataclass(frozen=True)
class Call:
    """One tool call as the client sees it: ``id``, function ``name``, ``arguments`` (JSON text)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        """OpenAI's ``tool_calls`` entry (with ``index`` in a stream's delta)."""
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def json_schema_spec(schema: dict) -> str:
    """A JSON schema as the engine's ``json`` structured output: objects that do not say
    otherwise take no properties beyond those listed (xgrammar's strict mode, vLLM's default),
    and no whitespace beyond ``", "`` and ``": "``, unless the schema sets llguidance's
    ``x-guidance`` options itself. Every output still validates against ``schema``."""
    closed = _closed(schema)
    if isinstance(closed, dict) and "x-guidance" not in closed:
        closed = {**closed, "x-guidance": _COMPACT}
    return json.dumps(closed)


def _closed(node):
    if isinstance(node, list):
        return [_closed(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in ("enum", "const", "default", "examples") else _closed(v))
           for k, v in node.items()}
    if "properties" in node and not any(k in node for k in _OPEN_OBJECT_KEYS):
        out["additionalProperties"] = False
    return out


# --- the prompt ----------------------------------------------------------------------------

def template_message(message, role: str, where: str) -> dict:
    """One gateway ``ChatMessage`` as the chat template's dict, transformers' way: an
    assistant's ``tool_calls`` as ``{"id", "type": "function", "function": {"name",
    "arguments": {...}}}`` (arguments parsed: templates write them with ``tojson``), a tool
    message's ``tool_call_id``. Raises ValueError naming ``{where}.tool_calls[j].arguments``
    when a call's arguments are not a JSON object."""
    out = {"role": role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": _arguments(c.arguments, f"{where}.tool_calls[{j}].function.arguments")}}
            for j, c in enumerate(message.tool_calls)]
    if role == "tool":
        out["tool_call_id"] = message.tool_call_id
    return out


def _arguments(text: str, where: str) -> dict:
    try:
        value = json.loads(text or "{}")
    except ValueError as exc:
        raise InvalidArgument(where, f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise InvalidArgument(where, "must be a JSON object")
    return value


def openai_tools(tools) -> list[dict]:
    """Gateway ``Tool`` messages as OpenAI's tool objects (what templates are given)."""
    return [{"type": "function", "function": {
        "name": t.name, **({"description": t.description} if t.description else {}),
        "parameters": json.loads(t.parameters) if t.parameters else JSON_OBJECT}} for t in tools]


def template_inputs(messages: list[dict], tools, template: str | None,
                    ) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for ``Tokenizer.apply_chat_template``: as they are for a template that
    knows tools, else written into the messages in the Hermes format (the module docstring)."""
    specs = openai_tools(tools) if tools else None
    calls_or_results = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if "tools" in (template or "") or not (specs or calls_or_results):
        return messages, specs
    out = [_hermes_message(m) for m in messages]
    merged: list[dict] = []
    for m in out:  # consecutive tool results share one user turn (as Qwen2.5's template does)
        if merged and m.get("_result") and merged[-1].get("_result"):
            merged[-1] = {**merged[-1], "content": merged[-1]["content"] + "\n" + m["content"]}
        else:
            merged.append(m)
    merged = [{k: v for k, v in m.items() if k != "_result"} for m in merged]
    if specs:
        block = _tools_prompt(specs)
        if merged[0]["role"] == "system":
            merged[0] = {**merged[0], "content": f"{merged[0]['content']}\n\n{block}".lstrip()}
        else:
            merged.insert(0, {"role": "system", "content": block})
    return merged, None


def _hermes_message(m: dict) -> dict:
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>",
                "_result": True}
    if m.get("tool_calls"):
        calls = "\n".join(f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                          "arguments": c["function"]["arguments"]})
                          + f"\n{CALL_CLOSE}" for c in m["tool_calls"])
        return {"role": m["role"], "content": f"{m['content']}\n{calls}".lstrip("\n")}
    return {"role": m["role"], "content": m["content"]}


def _tools_prompt(specs: list[dict]) -> str:
    signatures = "\n".join(json.dumps(s) for s in specs)
    return ("# Tools\n\nYou can call functions to help with the user's request. Their "
            f"signatures are between <tools></tools>:\n<tools>\n{signatures}\n</tools>\n\n"
            "To call one, answer with a JSON object holding the function's name and its "
            f"arguments between {CALL_OPEN}{CALL_CLOSE} tags, one call per pair:\n"
            f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_CLOSE}')


# --- tool_choice as a constraint ------------------------------------------------------------

def required_schema(specs: list[dict], parallel: bool) -> dict:
    """``tool_choice: required``'s output: a non-empty JSON array of calls, each
    ``{"name": one of the tools, "parameters": its arguments}`` (at most one unless
    ``parallel``)."""
    calls = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [s["function"]["name"]]},
        "parameters": s["function"].get("parameters") or JSON_OBJECT},
        "required": ["name", "parameters"]} for s in specs]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}


# --- reading calls out of the output -------------------------------------------------------

class _Parser:
    """Reads tool calls out of one choice's output, streamed in pieces: ``feed(text)`` returns
    (content to send now, ``tool_calls`` deltas to send now: OpenAI's entries with ``index``);
    ``finish()`` the rest at the end. ``calls``: every call so far, for a whole response."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def _add(self, call: Call) -> dict:
        self.calls.append(call)
        return call.openai(len(self.calls) - 1)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[dict]]:
        return "", []


class HermesParser(_Parser):
    """``tool_choice: auto``: text with ``<tool_call>{json}</tool_call>`` blocks. Content never
    shows a tag, nor the start of one, held back until it is decided; a block that is not a
    JSON call with a ``name`` stays content, as written."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""  # undecided text: a possible tag start, or an open block
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._buffer += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._buffer.find(CALL_CLOSE)
                if end < 0:
                    return content, calls
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_CLOSE):]
                self._in_call = False
                call = _call_of(body)
                if call is None:
                    content += CALL_OPEN + body + CALL_CLOSE
                else:
                    calls.append(self._add(call))
                continue
            start = self._buffer.find(CALL_OPEN)
            if start >= 0:
                content += self._buffer[:start]
                self._buffer = self._buffer[start + len(CALL_OPEN):]
                self._in_call = True
                continue
            keep = _partial_tag(self._buffer)
            content += self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return content, calls

    def finish(self) -> tuple[str, list[dict]]:
        """At the end of the output: an unclosed block is a call if its JSON is whole (models
        often stop before the closing tag), else content; a held-back tag start is content."""
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            call = _call_of(rest)
            if call is not None:
                return "", [self._add(call)]
            return CALL_OPEN + rest, []
        return rest, []


def _partial_tag(text: str) -> int:
    """Length of the longest end of ``text`` that begins ``<tool_call>``."""
    for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def _call_of(body: str) -> Call | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return Call(obj["name"], args if isinstance(args, str) else json.dumps(args))


class NamedParser(_Parser):
    """A named ``tool_choice``: the whole output is the call's arguments, streamed as they
    come (the first delta names the function)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.calls = [Call(name, "")]

    def feed(self, text: str) -> tuple[str, list[dict]]:
        call = self.calls[0]
        started = bool(call.arguments)
        if not text:
            return "", []
        self.calls = [Call(call.name, call.arguments + text, call.id)]
        if started:
            return "", [{"index": 0, "function": {"arguments": text}}]
        return "", [call.openai(0) | {"function": {"name": call.name, "arguments": text}}]


class ArrayParser(_Parser):
    """``tool_choice: required``: the output is a JSON array of ``{"name", "parameters"}``;
    each call is sent as soon as its object is whole."""

    _decoder = json.JSONDecoder()
    _separators = re.compile(r"[\s\[,]*")

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._pos = 0  # where the next element (or a separator) starts

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._text += text
        found = []
        while True:
            start = self._separators.match(self._text, self._pos).end()
            if start >= len(self._text) or self._text[start] == "]":
                return "", found
            try:
                obj, end = self._decoder.raw_decode(self._text, start)
            except ValueError:
                return "", found  # not whole yet
            self._pos = end
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                found.append(self._add(Call(obj["name"], json.dumps(obj.get("parameters", {})))))


def parser_for(tool_choice: str | None, named: str | None):
    """The parser of a chat request's output: None without tools (or with ``none``)."""
    if named is not None:
        return NamedParser(named)
    if tool_choice == "required":
        return ArrayParser()
    if tool_choice == "auto":
        return HermesParser()
    return None
