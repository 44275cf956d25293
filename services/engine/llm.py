"""In-process API (the ``unified`` role without services): ``LLM(...).generate(...)``."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .engine import EngineConfig, LLMEngine
from .output_processor import OutputProcessor
from .sampler import TokenLogprobs
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)


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
        """Generate for every prompt (text, or token ids); results in input order.

        Raises ValueError naming the field for a bad prompt."""
        params = params or SamplingParams()
        done: dict[str, Completion] = {}
        texts: dict[str, OutputProcessor] = {}
        for prompt in prompts:
            tokens = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(self.engine.make_request(request_id, tokens, params))
            done[request_id] = Completion(tokens)
            texts[request_id] = OutputProcessor(self.tokenizer, params)
        while self.engine.has_work():
            for out in self.engine.step():
                c = done[out.request_id]
                c.token_ids.extend(out.new_token_ids)
                c.logprobs.extend(out.logprobs or ())
                text, stopped = texts[out.request_id].process(out.new_token_ids)
                c.text += text
                if stopped:
                    self.engine.abort(out.request_id)
                    c.finish_reason = "stop"
                elif out.finish_reason:
                    c.text += texts[out.request_id].flush()
                    c.finish_reason = out.finish_reason
        return list(done.values())

    def chat(self, conversations: list[list[dict[str, str]]], params: SamplingParams | None = None,
             ) -> list[Completion]:
        """Apply the model's chat template to each conversation, then ``generate``."""
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c)) for c in conversations]
        return self.generate(prompts, params)
