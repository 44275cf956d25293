"""Token sampling for a batch: greedy, temperature, top-k, top-p, per-request seeds.

Random rows use the exponential-race form of categorical sampling (``argmax(p / E)`` with
``E ~ Exp(1)``, as vLLM's sampler does): each request draws its noise from its own
``torch.Generator``, so a seeded request samples the same tokens whatever else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request


@dataclass
class SamplingMetadata:
    """Per-row sampling settings for one step, ``[num_seqs]`` each."""

    temperature: torch.Tensor  # float32; rows with 0 are greedy
    top_p: torch.Tensor  # float32 in (0, 1]
    top_k: torch.Tensor  # int64; 0 disables
    generators: list[torch.Generator | None]  # None for greedy rows
    all_greedy: bool
    any_top_p_top_k: bool

    @classmethod
    def from_requests(cls, requests: list[Request], generators: dict[str, torch.Generator]):
        params = [r.sampling_params for r in requests]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
        gens = [None if p.greedy else generators[r.request_id] for r, p in zip(requests, params)]
        return cls(
            temperature, top_p, top_k, gens,
            all_greedy=all(p.greedy for p in params),
            any_top_p_top_k=any(p.top_p < 1.0 or p.top_k > 0 for p in params),
        )


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed``, or from OS entropy when None."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logits: ``[num_seqs, vocab]`` float32 -> sampled token ids ``[num_seqs]`` int64."""
    greedy_ids = logits.argmax(dim=-1)
    if meta.all_greedy:
        return greedy_ids
    temperature = torch.where(meta.temperature > 0, meta.temperature, 1.0)
    logits = logits / temperature.unsqueeze(1)
    if meta.any_top_p_top_k:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = torch.softmax(logits, dim=-1)
    noise = torch.ones_like(probs)
    for i, gen in enumerate(meta.generators):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    random_ids = (probs / noise).argmax(dim=-1)
    return torch.where(meta.temperature > 0, random_ids, greedy_ids)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and outside its top-p nucleus.

    Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (Holtzman
    et al. 2020); at least one token always survives. Vectorised: one sort per step.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    mask = ranks >= k
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    mask = mass_before >= top_p.unsqueeze(1)
    mask[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
