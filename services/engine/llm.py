"""In-process API (the ``unified`` role without services): ``LLM(...).generate(...)``."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from .engine import EngineConfig, LLMEngine
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


class LLM:
    """Offline generation with continuous batching over all given prompts.

    >>> llm = LLM()
    >>> llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(temperature=0))[0].text
    """

    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        self.engine = LLMEngine(config or EngineConfig(**kwargs))
        self.tokenizer = Tokenizer.load(self.engine.config.model)
        self._ids = itertools.count()

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | None = None,
                 ) -> list[Completion]:
        """Generate for every prompt (text, or token ids); results in input order."""
        params = params or SamplingParams()
        token_lists = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        ids = []
        for tokens in token_lists:
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(self.engine.make_request(request_id, tokens, params))
            ids.append(request_id)
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        reasons: dict[str, str] = {}
        while self.engine.has_work():
            for out in self.engine.step():
                outputs[out.request_id].extend(out.new_token_ids)
                if out.finish_reason:
                    reasons[out.request_id] = out.finish_reason
        return [
            Completion(toks, outputs[i], self.tokenizer.decode(outputs[i]), reasons[i])
            for i, toks in zip(ids, token_lists)
        ]

    def chat(self, conversations: list[list[dict[str, str]]], params: SamplingParams | None = None,
             ) -> list[Completion]:
        """Apply the model's chat template to each conversation, then ``generate``."""
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c)) for c in conversations]
        return self.generate(prompts, params)
