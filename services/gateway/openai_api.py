"""OpenAI's HTTP request and response shapes (the subset Tandem serves), translated to and from
the gateway's own ``GenerateRequest`` / ``GenerateResponse``: the HTTP front end validates the
JSON here and then calls the same pipeline as gRPC. Field names and defaults follow OpenAI's
API reference and vLLM's extra body fields (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``)."""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from services.api import gateway_pb2


class ChatMessageIn(BaseModel):
    role: str
    content: str


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extra body fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)

    def _common_fields(self) -> dict:
        if self.n != 1:
            raise ValueError("n: only 1 is supported")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: token ids are not negative")
        fields = {name: getattr(self, name) for name in (
            "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k",
            "min_p", "repetition_penalty", "min_tokens") if getattr(self, name) is not None}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {**fields, "model": self.model or "", "stop": stop, "ignore_eos": self.ignore_eos,
                "stop_token_ids": self.stop_token_ids}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

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
            messages=[gateway_pb2.ChatMessage(role=m.role, content=m.content) for m in self.messages])


class CompletionRequest(_Common):
    prompt: str
    max_tokens: int | None = 16  # OpenAI's default for completions
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


def usage(last: gateway_pb2.GenerateResponse | None) -> dict | None:
    if last is None or not last.HasField("usage"):
        return None
    u = last.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens}


def chat_logprobs(msg: gateway_pb2.GenerateResponse) -> dict | None:
    if not msg.logprobs:
        return None
    return {"content": [{"token": lp.text, "logprob": lp.logprob, "bytes": list(lp.text.encode()),
                         "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
                                          for t in lp.top_logprobs]} for lp in msg.logprobs]}


def completion_logprobs(msg: gateway_pb2.GenerateResponse) -> dict | None:
    if not msg.logprobs:
        return None
    return {"tokens": [lp.text for lp in msg.logprobs],
            "token_logprobs": [lp.logprob for lp in msg.logprobs],
            "top_logprobs": [{t.text: t.logprob for t in lp.top_logprobs} for lp in msg.logprobs],
            "text_offset": []}


class Chunker:
    """Builds the chunk and the whole-response JSON of one request, chat or completion."""

    def __init__(self, kind: Literal["chat", "completion"], request_id: str, model: str) -> None:
        self.kind = kind
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self._first = True

    def chunk(self, msg: gateway_pb2.GenerateResponse) -> dict:
        reason = msg.finish_reason or None
        if self.kind == "chat":
            delta = {"content": msg.text}
            if self._first:
                delta["role"] = "assistant"
            self._first = False
            choice = {"index": 0, "delta": delta, "logprobs": chat_logprobs(msg), "finish_reason": reason}
            return self._envelope("chat.completion.chunk", [choice], None)
        choice = {"index": 0, "text": msg.text, "logprobs": completion_logprobs(msg), "finish_reason": reason}
        return self._envelope("text_completion", [choice], None)

    def usage_chunk(self, last: gateway_pb2.GenerateResponse | None) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, [], usage(last))

    def whole(self, msgs: list[gateway_pb2.GenerateResponse]) -> dict:
        text = "".join(m.text for m in msgs)
        last = msgs[-1] if msgs else None
        reason = last.finish_reason if last else None
        merged = gateway_pb2.GenerateResponse(logprobs=[lp for m in msgs for lp in m.logprobs])
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": chat_logprobs(merged), "finish_reason": reason}
            return self._envelope("chat.completion", [choice], usage(last))
        choice = {"index": 0, "text": text, "logprobs": completion_logprobs(merged), "finish_reason": reason}
        return self._envelope("text_completion", [choice], usage(last))

    def _envelope(self, obj: str, choices: list, usage_: dict | None) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_}
