"""Token sampling for a batch, vectorised over rows (no Python loop over the vocabulary).

Order, as in vLLM's sampler: logprobs of the raw logits; ``min_tokens`` masking of EOS and stop
tokens; repetition (CTRL, Keskar et al. 2019: divide positive / multiply negative logits of
tokens seen in prompt or output), frequency and presence penalties (OpenAI's definitions);
greedy rows take the argmax here; then temperature, min-p (Nguyen et al. 2024), top-k and
top-p (Holtzman et al. 2020). Random rows use the exponential race ``argmax(p / E)`` with
``E ~ Exp(1)`` drawn from each request's own ``torch.Generator``, so a seeded request samples
the same tokens whatever else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from .request import Request


@dataclass
class SamplingMetadata:
    """Per-row settings for one step; tensors are ``[num_seqs]`` unless noted."""

    temperature: torch.Tensor  # float32; 0 = greedy row (temperature below SAMPLING_EPS)
    top_p: torch.Tensor
    top_k: torch.Tensor  # int64; 0 disables
    min_p: torch.Tensor
    generators: list[torch.Generator | None]  # None for greedy rows
    all_greedy: bool
    any_top_p_top_k: bool
    any_min_p: bool
    penalties: dict[str, torch.Tensor] | None  # see _penalty_inputs
    suppress: list[tuple[int, list[int]]]  # (row, token ids) masked while below min_tokens
    max_num_logprobs: int | None  # largest top-N asked for in the batch; None: nobody asked

    @classmethod
    def from_requests(cls, requests: list[Request], generators: dict[str, torch.Generator]):
        params = [r.sampling_params for r in requests]
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=f32([0.0 if p.greedy else p.temperature for p in params]),
            top_p=f32([p.top_p for p in params]),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
            min_p=f32([p.min_p for p in params]),
            generators=[None if p.greedy else generators[r.request_id] for r, p in zip(requests, params)],
            all_greedy=all(p.greedy for p in params),
            any_top_p_top_k=any(p.top_p < 1.0 or p.top_k > 0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
            penalties=_penalty_inputs(requests) if any(p.has_penalties for p in params) else None,
            suppress=[(i, _stop_ids(r)) for i, r in enumerate(requests)
                      if len(r.output_token_ids) < r.sampling_params.min_tokens],
            max_num_logprobs=max(asked) if asked else None,
        )


def plain_greedy(r: Request) -> bool:
    """Whether ``r``'s next token is the argmax of its raw logits: greedy, no penalties, no
    logprobs asked, and past ``min_tokens`` (nothing masked). A batch of only such rows needs
    no ``SamplingMetadata``: ``logits.argmax(-1)`` is what ``sample`` would return."""
    p = r.sampling_params
    return (p.greedy and not p.has_penalties and p.logprobs is None
            and len(r.output_token_ids) >= p.min_tokens)


def _stop_ids(r: Request) -> list[int]:
    ids = list(r.sampling_params.stop_token_ids)
    if r.eos_token_id is not None and not r.sampling_params.ignore_eos:
        ids.append(r.eos_token_id)
    return ids


def _penalty_inputs(requests: list[Request]) -> dict[str, torch.Tensor]:
    params = [r.sampling_params for r in requests]
    ids = lambda xs: torch.tensor(xs or [-1], dtype=torch.int64)  # noqa: E731 (-1: padding)
    return {
        "presence": torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
        "frequency": torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
        "repetition": torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
        "output_ids": pad_sequence([ids(r.output_token_ids) for r in requests], True, -1),  # [B, L]
        "prompt_ids": pad_sequence([ids(r.prompt_token_ids) for r in requests], True, -1),  # [B, P]
    }


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [num_seqs] int64
    logprobs: torch.Tensor | None = None  # [num_seqs] float32: log p(chosen) under the raw logits
    top_ids: torch.Tensor | None = None  # [num_seqs, N] int64, most likely first
    top_logprobs: torch.Tensor | None = None  # [num_seqs, N] float32


@dataclass
class TokenLogprobs:
    """One sampled token's log-probability and the ``top`` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first

    @classmethod
    def from_sampler(cls, out: SamplerOutput, row: int, num_top: int) -> TokenLogprobs:
        top = list(zip(out.top_ids[row, :num_top].tolist(), out.top_logprobs[row, :num_top].tolist()))
        return cls(int(out.token_ids[row]), float(out.logprobs[row]), top)

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": self.top}

    @classmethod
    def from_dict(cls, d: dict) -> TokenLogprobs:
        return cls(int(d["token_id"]), float(d["logprob"]), [(int(i), float(l)) for i, l in d["top"]])


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed``, or from OS entropy when None."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    """logits: ``[num_seqs, vocab]`` float32 (not modified) -> sampled tokens (+ logprobs)."""
    raw = logits
    if meta.suppress:
        logits = logits.clone()
        for row, ids in meta.suppress:
            logits[row, ids] = float("-inf")
    if meta.penalties is not None:
        logits = apply_penalties(logits, **meta.penalties)
    token_ids = logits.argmax(dim=-1)
    if not meta.all_greedy:
        token_ids = torch.where(meta.temperature > 0, _sample_random(logits, meta), token_ids)
    out = SamplerOutput(token_ids)
    if meta.max_num_logprobs is not None:
        lp = torch.log_softmax(raw, dim=-1)
        out.logprobs = lp.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        out.top_logprobs, out.top_ids = lp.topk(meta.max_num_logprobs, dim=-1)
    return out


def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    temperature = torch.where(meta.temperature > 0, meta.temperature, 1.0)
    logits = logits / temperature.unsqueeze(1)
    if meta.any_min_p:
        probs = torch.softmax(logits, dim=-1)
        threshold = meta.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if meta.any_top_p_top_k:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = torch.softmax(logits, dim=-1)
    noise = torch.ones_like(probs)
    for i, gen in enumerate(meta.generators):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor, output_ids: torch.Tensor, prompt_ids: torch.Tensor,
                    ) -> torch.Tensor:
    """Penalise ``[num_seqs, vocab]`` logits by each row's token history (ids padded with -1)."""
    num_seqs, vocab = logits.shape
    counts = torch.zeros(num_seqs, vocab + 1)  # last column absorbs the padding
    counts.scatter_add_(1, output_ids.masked_fill(output_ids < 0, vocab), torch.ones(output_ids.shape))
    counts = counts[:, :vocab]
    if bool((repetition != 1.0).any()):
        seen = torch.zeros(num_seqs, vocab + 1, dtype=torch.bool)
        seen.scatter_(1, prompt_ids.masked_fill(prompt_ids < 0, vocab), True)
        seen = seen[:, :vocab] | (counts > 0)
        rep = repetition.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0).float()


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and outside its top-p nucleus: the
    smallest set of most likely tokens whose mass reaches ``top_p``; one token always survives.
    One sort per step."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    mask = mass_before >= top_p.unsqueeze(1)
    mask[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
