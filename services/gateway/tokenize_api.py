"""vLLM's ``/tokenize`` and ``/detokenize``: the token ids the gateway would send for a prompt
(text, or chat messages through the chat template, tools included) and the text of token ids,
in vLLM's request and response shapes.

``/tokenize``: ``{"model", "prompt"}`` or ``{"model", "messages", "tools",
"add_generation_prompt": true}`` (``return_token_strs`` adds each token's text) ->
``{"count", "max_model_len", "tokens", "token_strs"}``. ``/detokenize``: ``{"model",
"tokens"}`` -> ``{"prompt"}``. Options of vLLM's that would tokenize differently from what
``/v1/chat/completions`` and ``/v1/completions`` do (``add_special_tokens``,
``continue_final_message``, ``chat_template``, ...) are refused as unrecognized keys.
"""
from __future__ import annotations

from typing import Any

from services.api import gateway_pb2
from services.engine.tokenizer import Tokenizer
from services.errors import InvalidArgument
from services.gateway.model_card import ModelCard
from services.gateway.openai_api import ChatCompletionRequest, ChatMessage, OpenAIObject


class TokenizeRequest(OpenAIObject):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: Any = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def to_proto(self) -> gateway_pb2.GenerateRequest:
        """The prompt as the gateway's request. Raises ValueError naming the field."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidArgument("prompt", "give exactly one of prompt and messages")
        if not self.add_generation_prompt:
            raise InvalidArgument("add_generation_prompt", "only true (what chat completions render) "
                                  "is supported")
        if self.prompt is not None:
            if self.tools is not None:
                raise InvalidArgument("tools", "need messages")
            return gateway_pb2.GenerateRequest(model=self.model or "", prompt=self.prompt)
        chat = ChatCompletionRequest.model_validate(
            {"messages": [m.model_dump(exclude_none=True) for m in self.messages], "tools": self.tools})
        proto = chat.to_protos("")[0]
        return gateway_pb2.GenerateRequest(model=self.model or "", messages=proto.messages,
                                           tools=proto.tools)

    def answer(self, ids: list[int], max_model_len: int, tokenizer: Tokenizer) -> dict:
        strs = [tokenizer.backend.id_to_token(t) for t in ids] if self.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


class DetokenizeRequest(OpenAIObject):
    model: str | None = None
    tokens: list[int]

    def answer(self, model: ModelCard, tokenizer: Tokenizer) -> dict:
        """``{"prompt": text}``. Raises ValueError naming ``model`` or ``tokens[i]``."""
        if self.model and self.model != model.name:
            raise InvalidArgument("model", f"{self.model!r} is not served here (serving {model.name!r})")
        for i, t in enumerate(self.tokens):
            if not 0 <= t < model.vocab_size:
                raise InvalidArgument(f"tokens[{i}]", f"{t} is not a token id of the model (ids are 0 to "
                                      f"{model.vocab_size - 1})")
        return {"prompt": tokenizer.decode(self.tokens, skip_special_tokens=False)}
