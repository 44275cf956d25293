"""OpenAI's HTTP response shapes, built from the gateway's ``GenerateResponse``s:
``CreateChatCompletionResponse`` and its stream chunks (``CreateChatCompletionStreamResponse``),
``CreateCompletionResponse`` (whole and streamed), ``CompletionUsage`` and OpenAI's error
object, as OpenAI's OpenAPI document defines them (vendored in
``tests/contract/openai-openapi.yaml``; ``tests/contract`` validates every shape against it).

A request has ``num_prompts`` prompts (a completions batch; chat has one) and ``n`` choices per
prompt; choice ``index`` is ``prompt * n + j``, the order OpenAI gives a batch's choices.
"""
from __future__ import annotations

import time
from typing import Literal

from services.api import gateway_pb2

# OpenAI's error ``type`` by HTTP status; any other 4xx is invalid_request_error
_ERROR_TYPES = {401: "invalid_request_error", 429: "rate_limit_error"}


def error_body(message: str, status: int, code: str | None = None) -> dict:
    """OpenAI's error JSON; ``param`` is the field our messages start with (``name: ...``)."""
    head = message.split(":", 1)[0]
    param = head if ":" in message and " " not in head else None
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(finals: dict[int, gateway_pb2.GenerateResponse], n: int) -> dict | None:
    """OpenAI's ``usage`` of a request from its choices' last responses (by index; ``n``
    choices per prompt): each prompt's tokens once, completion tokens summed over the choices,
    cached tokens of each prompt's first finished choice (the others reuse its prefix: counting
    them would exceed the prompt). None before any finished."""
    if not finals:
        return None
    firsts: dict[int, gateway_pb2.Usage] = {}
    for index in sorted(finals):
        firsts.setdefault(index // n, finals[index].usage)
    prompt = sum(u.prompt_tokens for u in firsts.values())
    completion = sum(m.usage.completion_tokens for m in finals.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in firsts.values())}}


def chat_logprobs(msg: gateway_pb2.GenerateResponse) -> dict | None:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}],
    "refusal": null}``."""
    if not msg.logprobs:
        return None
    return {"content": [{"token": lp.text, "logprob": lp.logprob, "bytes": list(lp.text.encode()),
                         "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
                                          for t in lp.top_logprobs]} for lp in msg.logprobs],
            "refusal": None}


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
    ``n`` choices for each of ``num_prompts`` prompts; every chunk and the whole response share
    one ``id`` and ``created``."""

    def __init__(self, kind: Literal["chat", "completion"], request_id: str, model: str, n: int = 1,
                 num_prompts: int = 1) -> None:
        self.kind = kind
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"
        self.model = model
        self.n = n
        self.created = int(time.time())
        self._object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._started: set[int] = set()  # choices whose first chunk went out (chat: the role)
        self._offsets = [0] * (n * num_prompts)  # completions: characters sent per choice
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
        return self._envelope(self._object, [], usage(self._finals, self.n))

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
                message = {"role": "assistant", "content": text, "refusal": None}
                choices.append({"index": index, "message": message,
                                "logprobs": chat_logprobs(merged), "finish_reason": reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": completion_logprobs(merged),
                                "finish_reason": reason})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, choices, usage(self._finals, self.n))

    def _envelope(self, obj: str, choices: list, usage_: dict | None) -> dict:
        """The object around ``choices``; ``usage`` only where there is one (a stream's chunks
        have none until ``usage_chunk``)."""
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}
        if usage_ is not None:
            body["usage"] = usage_
        return body
