"""OpenAI's HTTP request and response shapes (the subset Tandem serves), translated to and from
the gateway's own ``GenerateRequest`` / ``GenerateResponse``: the HTTP front end validates the
JSON here and then calls the same pipeline as gRPC. Field names and defaults follow OpenAI's
API reference and vLLM's extra body fields (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``)."""
from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.api import gateway_pb2

Int32 = Annotated[int, Field(ge=-2**31, le=2**31 - 1)]  # the gateway proto's int32 fields


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    role: str
    content: str | list[TextPart]  # a list of text parts is joined (OpenAI's content parts)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1)  # choices; at most the gateway's max_n (check_n)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extra body fields
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int32 | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**32)]] = Field(default_factory=list)

    def check_n(self, max_n: int) -> None:
        """Raises ValueError naming ``n`` when it exceeds ``max_n`` (setting max_n)."""
        if self.n > max_n:
            raise ValueError(f"n: {self.n} choices exceed the gateway's limit of {max_n} "
                             "(setting max_n)")

    def _common_fields(self) -> dict:
        fields = {name: getattr(self, name) for name in (
            "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k",
            "min_p", "repetition_penalty", "min_tokens") if getattr(self, name) is not None}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {**fields, "model": self.model or "", "stop": stop, "ignore_eos": self.ignore_eos,
                "stop_token_ids": self.stop_token_ids}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessageIn]
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None

    def to_proto(self, request_id: str) -> gateway_pb2.GenerateRequest:
        """The gateway request. Raises ValueError naming the field."""
        if not self.messages:
            raise ValueError("messages: must not be empty")
        fields = self._common_fields()
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        if self.top_logprobs is not None:
            fields["top_logprobs"] = self.top_logprobs
        return gateway_pb2.GenerateRequest(
            request_id=request_id, logprobs=self.logprobs, **fields,
            messages=[gateway_pb2.ChatMessage(role=m.role, content=m.text()) for m in self.messages])


class CompletionRequest(_Common):
    prompt: str
    max_tokens: Int32 | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)

    def to_proto(self, request_id: str) -> gateway_pb2.GenerateRequest:
        """The gateway request. Raises ValueError naming the field."""
        fields = self._common_fields()
        if self.max_tokens is not None:
            fields["max_tokens"] = self.max_tokens
        if self.logprobs is not None:
            fields.update(logprobs=True, top_logprobs=self.logprobs)
        return gateway_pb2.GenerateRequest(request_id=request_id, prompt=self.prompt, **fields)


def error_body(message: str, status: int, code: str | None = None) -> dict:
    """OpenAI's error JSON; ``param`` is the field our messages start with (``name: ...``)."""
    param = message.split(":", 1)[0] if ":" in message and " " not in message.split(":", 1)[0] else None
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(finals: dict[int, gateway_pb2.GenerateResponse]) -> dict | None:
    """OpenAI's ``usage`` of a request from its choices' last responses (by index): prompt
    tokens once, completion tokens summed over the choices, cached tokens of choice 0 (the
    others reuse its prefix: counting them would exceed the prompt). None before any finished."""
    if not finals:
        return None
    first = finals[min(finals)].usage
    completion = sum(m.usage.completion_tokens for m in finals.values())
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


def chat_logprobs(msg: gateway_pb2.GenerateResponse) -> dict | None:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``."""
    if not msg.logprobs:
        return None
    return {"content": [{"token": lp.text, "logprob": lp.logprob, "bytes": list(lp.text.encode()),
                         "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
                                          for t in lp.top_logprobs]} for lp in msg.logprobs]}


def completion_logprobs(msg: gateway_pb2.GenerateResponse, offset: int = 0) -> dict | None:
    """Completions' ``logprobs``: parallel lists ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (token text -> logprob) and ``text_offset`` (characters into the choice's
    text, starting at ``offset``)."""
    if not msg.logprobs:
        return None
    offsets = []
    for lp in msg.logprobs:
        offsets.append(offset)
        offset += len(lp.text)
    return {"tokens": [lp.text for lp in msg.logprobs],
            "token_logprobs": [lp.logprob for lp in msg.logprobs],
            "top_logprobs": [{t.text: t.logprob for t in lp.top_logprobs} for lp in msg.logprobs],
            "text_offset": offsets}


class Chunker:
    """Builds the chunks and the whole-response JSON of one request (chat or completion) with
    ``n`` choices; every chunk and the whole response share one ``id`` and ``created``."""

    def __init__(self, kind: Literal["chat", "completion"], request_id: str, model: str, n: int = 1) -> None:
        self.kind = kind
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self._object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._started: set[int] = set()  # choices whose first chunk went out (chat: the role)
        self._offsets = [0] * n  # completions: characters of each choice sent so far
        self._finals: dict[int, gateway_pb2.GenerateResponse] = {}  # last response per choice

    def chunk(self, index: int, msg: gateway_pb2.GenerateResponse) -> dict:
        """The chunk of choice ``index`` for one response."""
        reason = msg.finish_reason or None
        if msg.HasField("usage"):
            self._finals[index] = msg
        if self.kind == "chat":
            delta = {"content": msg.text}
            if index not in self._started:
                delta["role"] = "assistant"
            self._started.add(index)
            choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(msg), "finish_reason": reason}
        else:
            choice = {"index": index, "text": msg.text, "finish_reason": reason,
                      "logprobs": completion_logprobs(msg, self._offsets[index])}
            self._offsets[index] += len(msg.text)
        return self._envelope(self._object, [choice], None)

    def usage_chunk(self) -> dict:
        """``stream_options.include_usage``'s last chunk: no choices, the request's usage."""
        return self._envelope(self._object, [], usage(self._finals))

    def whole(self, by_choice: list[list[gateway_pb2.GenerateResponse]]) -> dict:
        """The non-streaming response from every choice's responses, in index order."""
        choices = []
        for index, msgs in enumerate(by_choice):
            text = "".join(m.text for m in msgs)
            reason = msgs[-1].finish_reason if msgs else None
            if msgs and msgs[-1].HasField("usage"):
                self._finals[index] = msgs[-1]
            merged = gateway_pb2.GenerateResponse(logprobs=[lp for m in msgs for lp in m.logprobs])
            if self.kind == "chat":
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": chat_logprobs(merged), "finish_reason": reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": completion_logprobs(merged),
                                "finish_reason": reason})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, choices, usage(self._finals))

    def _envelope(self, obj: str, choices: list, usage_: dict | None) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_}
