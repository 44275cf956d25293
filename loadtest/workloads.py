"""Seeded, reproducible offline workloads: a list of requests (prompt token ids + output length).

``random``: token-id prompts and exact output lengths (``ignore_eos``) drawn from a
ShareGPT-like distribution: log-normal lengths (prompt median ~100 tokens, output median ~190
tokens, outputs clipped to [8, 512]), the shape of the length histograms that vLLM's
``benchmark_serving --dataset sharegpt`` reports. ``chat``: real instruct prompts
(``loadtest.chat_prompts``) rendered with the model's chat template, run to EOS (capped).
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

from loadtest.chat_prompts import CHAT_PROMPTS

PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_RANGE = 100, 1.0, (4, 512)  # tokens
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_RANGE = 190, 0.7, (8, 512)  # tokens
FIRST_NORMAL_TOKEN = 17  # ids 0-16 are control tokens in SmolLM2's vocabulary
CHAT_MAX_TOKENS = 512  # output cap of a chat request, in tokens


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # output tokens: exact when ignore_eos, else a cap
    ignore_eos: bool


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[BenchRequest, ...]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    def stats(self) -> dict[str, float]:
        """Medians and maxima of prompt and requested output lengths, in tokens (the requested
        output is exact when ``exact_output``, else a cap: the request stops at EOS)."""
        prompts = [len(r.prompt_token_ids) for r in self.requests]
        outputs = [r.max_tokens for r in self.requests]
        return {"num_requests": len(self.requests),
                "prompt_median": statistics.median(prompts), "prompt_max": max(prompts),
                "output_median": statistics.median(outputs), "output_max": max(outputs),
                "exact_output": all(r.ignore_eos for r in self.requests)}


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def random_workload(num_prompts: int, *, seed: int = 0, vocab_size: int = 49152,
                    max_output: int = OUTPUT_RANGE[1], max_prompt: int = PROMPT_RANGE[1]) -> Workload:
    """``num_prompts`` requests of random token ids with ShareGPT-like lengths (see module doc).

    ``max_output`` / ``max_prompt`` (tokens) clip the lengths further, for smoke runs.
    Same arguments, same workload. Raises ``ValueError`` on a non-positive ``num_prompts``.
    """
    if num_prompts <= 0:
        raise ValueError(f"num_prompts must be > 0, got {num_prompts}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        prompt_len = _lognormal_int(rng, PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_RANGE[0],
                                    min(max_prompt, PROMPT_RANGE[1]))
        output_len = _lognormal_int(rng, OUTPUT_MEDIAN, OUTPUT_SIGMA, min(OUTPUT_RANGE[0], max_output),
                                    min(max_output, OUTPUT_RANGE[1]))
        ids = tuple(rng.randrange(FIRST_NORMAL_TOKEN, vocab_size) for _ in range(prompt_len))
        requests.append(BenchRequest(ids, output_len, ignore_eos=True))
    return Workload("random", tuple(requests))


def chat_workload(num_prompts: int, tokenizer, *, seed: int = 0,
                  max_output: int = CHAT_MAX_TOKENS) -> Workload:
    """``num_prompts`` chat requests: the prompts of ``CHAT_PROMPTS`` in a seeded order (cycled
    when more are asked for), each one user turn rendered with ``tokenizer``'s chat template
    (a ``services.engine.tokenizer.Tokenizer``), run to EOS or ``max_output`` tokens."""
    if num_prompts <= 0:
        raise ValueError(f"num_prompts must be > 0, got {num_prompts}")
    order = list(CHAT_PROMPTS)
    random.Random(seed).shuffle(order)
    requests = []
    for i in range(num_prompts):
        text = tokenizer.apply_chat_template([{"role": "user", "content": order[i % len(order)]}])
        requests.append(BenchRequest(tuple(tokenizer.encode(text)), max_output, ignore_eos=False))
    return Workload("chat", tuple(requests))
