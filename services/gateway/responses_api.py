"""OpenAI's Responses API (``POST /v1/responses``), text in and text out: the request becomes
the same ``GenerateRequest`` a chat completion does, and the answer a ``response`` object, or,
streamed, its events (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``), as OpenAI's server sends them.

Honoured: ``input`` (a string, or a list of messages whose content is a string or
``input_text`` / ``output_text`` parts), ``instructions`` (a system message before the input),
``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``text.format`` (``text``,
``json_object``, ``json_schema``: a structured output), ``model``. Refused with 400 naming the
field (``REFUSED``): what needs state Tandem does not keep (``previous_response_id``,
``conversation``, ``store: true``, ``background``), tools, reasoning, and the rest that would
change the answer; a key the API does not have is refused as unrecognized.
"""
from __future__ import annotations

import time
from typing import Any

from services.api import gateway_pb2
from services.errors import InvalidArgument
from services.gateway.openai_api import (ChatMessage, Int32, Refused, equal_to, OpenAIObject,
                                         refuse, response_format_constraint)

REFUSED = {
    "previous_response_id": Refused("Tandem stores no responses to continue from"),
    "conversation": Refused("Tandem stores no conversations"),
    "store": Refused("Tandem stores no responses", equal_to(False)),
    "background": Refused("Tandem runs no background responses", equal_to(False)),
    "tools": Refused("tools are served on /v1/chat/completions, not here yet", equal_to([])),
    "tool_choice": Refused("tools are served on /v1/chat/completions, not here yet",
                           equal_to("none", "auto")),
    "parallel_tool_calls": Refused("tools are served on /v1/chat/completions, not here yet",
                                   equal_to(True, False)),
    "max_tool_calls": Refused("tools are served on /v1/chat/completions, not here yet"),
    "reasoning": Refused("the model does not reason before answering"),
    "include": Refused("no extra output items exist here", equal_to([])),
    "metadata": Refused("Tandem stores no responses to attach metadata to", equal_to({})),
    "prompt": Refused("Tandem has no stored prompt templates"),
    "top_logprobs": Refused("logprobs are served on /v1/chat/completions, not here yet",
                            equal_to(0)),
    "truncation": Refused("a prompt over the context is refused, never truncated",
                          equal_to("disabled")),
    "service_tier": Refused("Tandem has one service tier", equal_to("auto", "default")),
    "user": Refused("Tandem keeps no per-end-user accounting"),
    "safety_identifier": Refused("Tandem keeps no per-end-user accounting"),
    "prompt_cache_key": Refused("the prefix cache is keyed by the prompt's own KV blocks"),
    "stream_options": Refused("no stream options exist here"),
}
_PART_TYPES = ("input_text", "output_text", "text")


class ResponsesRequest(OpenAIObject):
    model: str | None = None
    input: Any = None
    instructions: str | None = None
    max_output_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    previous_response_id: Any = None
    conversation: Any = None
    store: Any = None
    background: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    max_tool_calls: Any = None
    reasoning: Any = None
    include: Any = None
    metadata: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    truncation: Any = None
    service_tier: Any = None
    user: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    stream_options: Any = None

    def to_proto(self, request_id: str) -> gateway_pb2.GenerateRequest:
        """The gateway request. Raises ValueError naming the field."""
        refuse({name: getattr(self, name) for name in self.model_fields_set}, REFUSED)
        messages = ([gateway_pb2.ChatMessage(role="system", content=self.instructions)]
                    if self.instructions is not None else [])
        messages += self._input_messages()
        fields: dict[str, Any] = {name: getattr(self, name) for name in ("temperature", "top_p")
                                  if getattr(self, name) is not None}
        if self.max_output_tokens is not None:
            fields["max_tokens"] = self.max_output_tokens
        fmt = self._format()
        if fmt is not None:
            fields["structured_outputs"] = fmt
        return gateway_pb2.GenerateRequest(request_id=request_id, model=self.model or "",
                                           messages=messages, **fields)

    def _input_messages(self) -> list[gateway_pb2.ChatMessage]:
        if isinstance(self.input, str):
            return [gateway_pb2.ChatMessage(role="user", content=self.input)]
        if not isinstance(self.input, list) or not self.input:
            raise InvalidArgument("input", "must be a string or a non-empty list of messages")
        out = []
        for i, item in enumerate(self.input):
            at = f"input[{i}]"
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                raise InvalidArgument(f"{at}.type", "only messages are accepted (text in, text out)")
            unknown = set(item) - {"type", "role", "content", "id", "status"}
            if unknown:
                raise InvalidArgument(f"{at}.{sorted(unknown)[0]}", "unrecognized")
            content = item.get("content")
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") not in _PART_TYPES:
                        raise InvalidArgument(f"{at}.content[{j}].type", "only text parts are accepted "
                                              "(input_text, output_text): the model reads text only")
                content = [{"type": "text", "text": part.get("text")} for part in content]
            message = ChatMessage.model_validate({"role": item.get("role"), "content": content})
            proto = message.to_proto(i)
            if proto.role == "tool":
                raise InvalidArgument(f"{at}.role", "tool results are served on /v1/chat/completions")
            out.append(proto)
        return out

    def _format(self) -> gateway_pb2.StructuredOutputs | None:
        """``text.format``: Responses' flat ``json_schema`` (name, schema, strict at the top)
        as chat's ``response_format``."""
        if self.text is None:
            return None
        unknown = set(self.text) - {"format", "verbosity"}
        if unknown or self.text.get("verbosity") not in (None, "medium"):
            raise InvalidArgument(f"text.{sorted(unknown)[0] if unknown else 'verbosity'}", "not supported")
        fmt = self.text.get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
        try:
            return response_format_constraint(fmt)
        except InvalidArgument as exc:  # named as chat's response_format: renamed
            raise exc.renamed(exc.param.replace("response_format.json_schema", "text.format", 1)
                              .replace("response_format", "text.format", 1)) from None


class ResponseBuilder:
    """The ``response`` object of one request and its stream events (numbered in order)."""

    def __init__(self, request_id: str, model: str, body: ResponsesRequest) -> None:
        self.id = f"resp_{request_id}"
        self.item_id = f"msg_{request_id}"
        self.model = model
        self.body = body
        self.created_at = int(time.time())
        self._sequence = 0
        self._text = ""

    def response(self, status: str, text: str | None = None, final: gateway_pb2.GenerateResponse | None = None) -> dict:
        """The ``response`` object: ``in_progress`` (no output yet), ``completed`` or
        ``incomplete`` (the output stopped at ``max_output_tokens``)."""
        output = [] if text is None else [self._item(text, "completed")]
        usage = None
        if final is not None and final.HasField("usage"):
            u = final.usage
            usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                     "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u.total_tokens}
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "model": self.model, "output": output, "parallel_tool_calls": False,
                "previous_response_id": None, "reasoning": None, "store": False,
                "temperature": b.temperature if b.temperature is not None else 1.0,
                "text": b.text or {"format": {"type": "text"}}, "tool_choice": "none", "tools": [],
                "top_p": b.top_p if b.top_p is not None else 1.0, "truncation": "disabled",
                "usage": usage, "metadata": {}}

    def whole(self, msgs: list[gateway_pb2.GenerateResponse]) -> dict:
        final = msgs[-1] if msgs else None
        return self.response(_status(final), "".join(m.text for m in msgs), final)

    def start_events(self) -> list[dict]:
        """The events before the first text: created, in_progress, the message item and its
        text part added."""
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress")),
                self._event("response.output_item.added", output_index=0,
                            item=self._item("", "in_progress", content=False)),
                self._event("response.content_part.added", item_id=self.item_id, output_index=0,
                            content_index=0, part=_part(""))]

    def delta_events(self, msg: gateway_pb2.GenerateResponse) -> list[dict]:
        """A text delta (if any); at the last response, the done events and the response."""
        events = []
        if msg.text:
            self._text += msg.text
            events.append(self._event("response.output_text.delta", item_id=self.item_id,
                                      output_index=0, content_index=0, delta=msg.text, logprobs=[]))
        if msg.finish_reason:
            status = _status(msg)
            events += [
                self._event("response.output_text.done", item_id=self.item_id, output_index=0,
                            content_index=0, text=self._text, logprobs=[]),
                self._event("response.content_part.done", item_id=self.item_id, output_index=0,
                            content_index=0, part=_part(self._text)),
                self._event("response.output_item.done", output_index=0,
                            item=self._item(self._text, "completed")),
                self._event(f"response.{status}", response=self.response(status, self._text, msg))]
        return events

    def _item(self, text: str, status: str, content: bool = True) -> dict:
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant",
                "content": [_part(text)] if content else []}

    def _event(self, kind: str, **fields) -> dict:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _status(final: gateway_pb2.GenerateResponse | None) -> str:
    return "incomplete" if final is not None and final.finish_reason == "length" else "completed"
