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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from services.api import gateway_pb2

# OpenAI's error ``type`` by HTTP status; any other 4xx is invalid_request_error
_ERROR_TYPES = {401: "invalid_request_error", 429: "rate_limit_error"}


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error JSON: ``param`` names the field at fault, ``code`` is OpenAI's error code
    (``services.errors``)."""
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


def completion_logprobs(msg: gateway_pb2.GenerateResponse, offset: int = 0,
                        echoed: bool = False) -> dict | None:
    """Completions' ``logprobs``: parallel lists ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (token text -> logprob) and ``text_offset`` (characters into the choice's
    text, starting at ``offset``). ``echoed``: the prompt's tokens (``msg.prompt_logprobs``)
    come first, the first of them with null logprobs (nothing precedes it)."""
    entries = [*(msg.prompt_logprobs if echoed else ()), *msg.logprobs]
    if not entries:
        return None
    offsets = []
    for lp in entries:
        offsets.append(offset)
        offset += len(lp.text)
    known = [not isinstance(lp, gateway_pb2.PromptLogprob) or lp.HasField("logprob") for lp in entries]
    return {"tokens": [lp.text for lp in entries],
            "token_logprobs": [lp.logprob if k else None for lp, k in zip(entries, known)],
            "top_logprobs": [{t.text: t.logprob for t in lp.top_logprobs} if k else None
                             for lp, k in zip(entries, known)],
            "text_offset": offsets}


def vllm_prompt_logprobs(msg: gateway_pb2.GenerateResponse) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token, null for the first, else ``{token id:
    {"logprob", "rank", "decoded_token"}}`` for the token itself and its alternatives (rank:
    its place among the alternatives, 1 the most likely; null when it is not among them)."""
    if not msg.prompt_logprobs:
        return None
    out: list = [None]
    for lp in msg.prompt_logprobs[1:]:
        entry = {str(t.token_id): {"logprob": t.logprob, "rank": r, "decoded_token": t.text}
                 for r, t in enumerate(lp.top_logprobs, 1)}
        entry.setdefault(str(lp.token_id), {"logprob": lp.logprob, "rank": None, "decoded_token": lp.text})
        out.append(entry)
    return out


@dataclass(frozen=True)
class Presentation:
    """What a request asked of its responses beyond the generated text."""

    echo: list[str] | None = None  # completions: each prompt's text, before its choices' text
    echo_logprobs: bool = False  # completions: the echoed prompt's tokens start ``logprobs``
    prompt_logprobs: bool = False  # vLLM's ``prompt_logprobs`` field
    tool_parser: Callable[[], object] | None = None  # chat with tools: reads calls (tool_calls.py)


class Chunker:
    """Builds the chunks and the whole-response JSON of one request (chat or completion) with
    ``n`` choices for each of ``num_prompts`` prompts; every chunk and the whole response share
    one ``id`` and ``created``."""

    def __init__(self, kind: Literal["chat", "completion"], request_id: str, model: str, n: int = 1,
                 num_prompts: int = 1, presentation: Presentation = Presentation()) -> None:
        self.kind = kind
        self.show = presentation
        self._parsers = ([presentation.tool_parser() for _ in range(n * num_prompts)]
                         if presentation.tool_parser else None)
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
        first = index not in self._started
        self._started.add(index)
        extra = {}
        if self.kind == "chat":
            delta: dict = {"content": msg.text}
            if self._parsers is not None:
                delta, reason = self._tool_delta(index, msg.text, reason)
            if first:
                delta = {"role": "assistant", **delta}
                if self.show.prompt_logprobs and msg.prompt_logprobs:
                    extra["prompt_logprobs"] = vllm_prompt_logprobs(msg)
            choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(msg), "finish_reason": reason}
        else:
            echo = self.show.echo[index // self.n] if first and self.show.echo is not None else ""
            text = echo + msg.text
            choice = {"index": index, "text": text, "finish_reason": reason,
                      "logprobs": completion_logprobs(msg, self._offsets[index],
                                                      echoed=first and self.show.echo_logprobs)}
            if first and self.show.prompt_logprobs:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(msg)
            self._offsets[index] += len(text)
        return self._envelope(self._object, [choice], None) | extra

    def _tool_delta(self, index: int, text: str, reason: str | None) -> tuple[dict, str | None]:
        """A chat delta with tool calls read out of ``text`` (content kept back while it may
        start a call), and the finish reason (``tool_calls`` when the choice made calls)."""
        parser = self._parsers[index]
        content, calls = parser.feed(text)
        if reason is not None:
            more, late = parser.finish()
            content, calls = content + more, calls + late
        delta: dict = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, ("tool_calls" if reason == "stop" and parser.calls else reason)

    def usage_chunk(self) -> dict:
        """``stream_options.include_usage``'s last chunk: no choices, the request's usage."""
        return self._envelope(self._object, [], usage(self._finals, self.n))

    def whole(self, by_choice: list[list[gateway_pb2.GenerateResponse]]) -> dict:
        """The non-streaming response from every choice's responses, in index order."""
        choices, extra = [], {}
        for index, msgs in enumerate(by_choice):
            text = "".join(m.text for m in msgs)
            reason = msgs[-1].finish_reason if msgs else None
            if msgs and msgs[-1].HasField("usage"):
                self._finals[index] = msgs[-1]
            merged = gateway_pb2.GenerateResponse(
                logprobs=[lp for m in msgs for lp in m.logprobs],
                prompt_logprobs=[lp for m in msgs for lp in m.prompt_logprobs])
            if self.kind == "chat":
                message = {"role": "assistant", "content": text, "refusal": None}
                if self._parsers is not None:
                    reason = self._tool_message(index, message, reason)
                choices.append({"index": index, "message": message,
                                "logprobs": chat_logprobs(merged), "finish_reason": reason})
                if self.show.prompt_logprobs and index == 0:
                    extra["prompt_logprobs"] = vllm_prompt_logprobs(merged)
            else:
                echo = self.show.echo[index // self.n] if self.show.echo is not None else ""
                choice = {"index": index, "text": echo + text, "finish_reason": reason,
                          "logprobs": completion_logprobs(merged, echoed=self.show.echo_logprobs)}
                if self.show.prompt_logprobs:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(merged)
                choices.append(choice)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, choices, usage(self._finals, self.n)) | extra

    def _tool_message(self, index: int, message: dict, reason: str | None) -> str | None:
        """Read the tool calls out of a whole message's content (in place); the finish reason
        (``tool_calls`` when it made calls)."""
        parser = self._parsers[index]
        content, _ = parser.feed(message["content"])
        more, _ = parser.finish()
        content += more
        if parser.calls:
            message["content"] = content or None
            message["tool_calls"] = [c.openai() for c in parser.calls]
            return "tool_calls" if reason == "stop" else reason
        message["content"] = content
        return reason

    def _envelope(self, obj: str, choices: list, usage_: dict | None) -> dict:
        """The object around ``choices``; ``usage`` only where there is one (a stream's chunks
        have none until ``usage_chunk``)."""
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}
        if usage_ is not None:
            body["usage"] = usage_
        return body
