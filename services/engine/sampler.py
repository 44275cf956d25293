"""Token sampling for a batch, on the logits' device, vectorised over rows: no Python loop over
the batch or the vocabulary, and no per-request generator state.

Order, as in vLLM's sampler: logprobs of the raw logits; structured outputs' token masks
(``grammars.py``) and ``logit_bias``; ``min_tokens`` masking of EOS and stop tokens; repetition (CTRL, Keskar et al. 2019: divide positive / multiply negative logits of
tokens seen in prompt or output), frequency and presence penalties (OpenAI's definitions);
greedy rows take the argmax here; then temperature, min-p (Nguyen et al. 2024), top-k and
top-p (Holtzman et al. 2020).

Random rows draw by inverse transform sampling: one uniform ``u`` per row, and the token is the
first whose cumulative probability (summed in vocabulary order) exceeds ``u`` times the total.
``u`` comes from a counter-based generator, SplitMix64's finaliser (Steele, Lea and Flood,
OOPSLA 2014) over the request's seed and the index of the output token being drawn
(``uniforms``), so the draw for output token ``i`` of a seeded request is a pure function of
(seed, i): the same whatever else is in the batch, on whichever worker draws it (the prefill
worker draws token 0, a decode worker the rest; a migrated request resumes at its next index),
after preemption, and on any device. Counter-based generators for parallel streams: Salmon et
al., "Parallel random numbers: as easy as 1, 2, 3" (SC 2011).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels import sampling as cpu_sampling
from kernels.decode_ops import argmax_rows

_MASK64 = np.uint64(2**64 - 1)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment (2^64 / golden ratio)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on ``uint64`` values (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def uniforms(seeds: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """One uniform in ``[0, 1)`` per row from its ``seeds`` (``[n]`` uint64) and the index of the
    output token being drawn (``indices``, ``[n]`` int): ``[n]`` float64 multiples of 2^-24, so
    they are exact in float32 and below 1 there too."""
    with np.errstate(over="ignore"):
        z = _splitmix64(seeds.astype(np.uint64) + _GOLDEN)
        z = _splitmix64(z ^ (indices.astype(np.uint64) * _GOLDEN))
    return (z >> np.uint64(40)).astype(np.float64) * 2.0**-24


@dataclass
class Penalties:
    """Penalty settings and token history of the rows that have penalties; tensors ``[p]``
    unless noted."""

    rows: torch.Tensor  # [p] int64: their rows in the batch
    presence: torch.Tensor  # float32, OpenAI: subtracted once per token seen in the output
    frequency: torch.Tensor  # float32, OpenAI: subtracted per occurrence in the output
    repetition: torch.Tensor  # float32, CTRL: 1 is off; prompt and output tokens
    history: torch.Tensor  # [p, max_len] int64: each row's tokens, padded with -1
    output_from: torch.Tensor  # [p] int64: index in ``history`` where output begins


@dataclass
class RandomDraws:
    """The rows that sample at random (temperature > 0) and their settings; tensors ``[r]``."""

    rows: torch.Tensor  # int64: their rows in the batch
    temperature: torch.Tensor  # float32
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # int64; 0 disables
    min_p: torch.Tensor  # float32
    uniforms: torch.Tensor  # float32 in [0, 1): each row's draw (``uniforms()``)
    filter_rows: torch.Tensor | None  # [f] int64, of these rows: those with top-k or top-p
    any_min_p: bool


@dataclass
class SamplingBatch:
    """One step's sampling settings for ``num_seqs`` sampled rows, on the logits' device; each
    part covers only the rows it concerns (None: none does). Flags are host booleans."""

    random: RandomDraws | None  # None: every row is greedy
    penalties: Penalties | None
    suppress: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) [k] int64 -> -inf
    # structured outputs: (rows [g] int64, bitmask [g, ceil(vocab / 32)] int32, 1 = allowed)
    allowed: tuple[torch.Tensor, torch.Tensor] | None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, ids, biases) [b]
    logprob_rows: torch.Tensor | None  # [l] int64: rows that asked for logprobs
    max_num_logprobs: int | None  # largest top-N asked for; None: nobody asked


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [num_seqs] int64
    # for the rows of SamplingBatch.logprob_rows, in that order:
    logprobs: torch.Tensor | None = None  # [l] float32: log p(chosen) under the raw logits
    top_ids: torch.Tensor | None = None  # [l, N] int64, most likely first
    top_logprobs: torch.Tensor | None = None  # [l, N] float32

    def to_host(self) -> tuple[list[int], np.ndarray | None, np.ndarray | None]:
        """Token ids, and with logprobs the logprob rows' top ids ``[l, N]`` (int64) and
        logprobs ``[l, 1 + N]`` (float32, the chosen token's first), in one device-to-host
        copy."""
        if self.logprobs is None:
            return self.token_ids.tolist(), None, None
        n, width = self.token_ids.shape[0], 1 + self.top_ids.shape[1]
        lps = torch.cat((self.logprobs.unsqueeze(1), self.top_logprobs), dim=1)
        # NOTE: float32 bits ride as int64 values beside the ids: one copy, not three
        packed = torch.cat((self.token_ids, self.top_ids.reshape(-1),
                            lps.contiguous().view(torch.int32).to(torch.int64).reshape(-1)))
        host = packed.cpu().numpy()
        chosen = host[:n]
        tops = host[n:n + self.top_ids.numel()].reshape(self.top_ids.shape)
        lp_host = host[n + self.top_ids.numel():].astype(np.int32).view(np.float32)
        return chosen.tolist(), tops, lp_host.reshape(-1, width)


@dataclass
class TokenLogprobs:
    """One sampled token's log-probability and the ``top`` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first

    @classmethod
    def from_rows(cls, token_id: int, top_ids: np.ndarray, logprobs: np.ndarray,
                  num_top: int) -> TokenLogprobs:
        """From one row of ``SamplerOutput.to_host``'s arrays: the top ids ``[N]``, and the
        logprobs ``[1 + N]`` (the chosen token's first)."""
        top = list(zip(top_ids[:num_top].tolist(), logprobs[1:1 + num_top].tolist()))
        return cls(token_id, float(logprobs[0]), top)

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": self.top}

    @classmethod
    def from_dict(cls, d: dict) -> TokenLogprobs:
        return cls(int(d["token_id"]), float(d["logprob"]), [(int(i), float(l)) for i, l in d["top"]])


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits: ``[num_seqs, vocab]`` float32 (not modified) -> sampled tokens (+ logprobs), on
    the logits' device. Each stage runs on the rows it concerns only. Raises ``IndexError``
    for a suppressed token id outside the vocabulary (CPU; the engine checks ids first)."""
    raw = logits
    if any(x is not None for x in (batch.suppress, batch.penalties, batch.allowed, batch.logit_bias)):
        logits = logits.clone()
    if batch.allowed is not None:
        rows, bitmask = batch.allowed
        logits[rows] = apply_token_bitmask(logits[rows], bitmask)
    if batch.logit_bias is not None:
        rows, ids, biases = batch.logit_bias
        logits.index_put_((rows, ids), biases, accumulate=True)
    if batch.suppress is not None:
        rows, ids = batch.suppress
        # a device-side -inf: assigning the Python float copied a host scalar to the GPU, a
        # synchronising copy in every step that suppresses (profile_decode_step's sync sites)
        logits.index_put_((rows, ids), logits.new_full((), float("-inf")))
    if (p := batch.penalties) is not None:
        logits[p.rows] = apply_penalties(logits[p.rows], p.presence, p.frequency, p.repetition,
                                         p.history, p.output_from)
    token_ids = argmax_rows(logits)
    if (r := batch.random) is not None:
        token_ids.index_copy_(0, r.rows, _sample_random(logits, r))
    out = SamplerOutput(token_ids)
    if batch.logprob_rows is not None:
        out.logprobs, out.top_ids, out.top_logprobs = logprobs_of(
            raw, batch.logprob_rows, token_ids[batch.logprob_rows], batch.max_num_logprobs)
    return out


def logprobs_of(logits: torch.Tensor, rows: torch.Tensor, chosen: torch.Tensor, num_top: int,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under ``log_softmax`` of ``logits`` (``[n, vocab]`` float32) rows ``rows`` (``[r]``):
    the logprobs of ``chosen`` (``[r]``), and the ``num_top`` most likely ids and their
    logprobs (``[r, num_top]``, most likely first). On a CPU by ``kernels.sampling`` (no
    ``[r, vocab]`` tensor; ties by the lower id), elsewhere by torch ops."""
    if _cpu_kernel_takes(logits):
        return cpu_sampling.logprobs_rows(logits.contiguous(), rows, chosen, num_top)
    lp = torch.log_softmax(logits[rows], dim=-1)
    top_lp, top_ids = lp.topk(num_top, dim=-1)
    return lp.gather(1, chosen.unsqueeze(1)).squeeze(1), top_ids, top_lp


def _cpu_kernel_takes(logits: torch.Tensor) -> bool:
    """Whether ``kernels.sampling`` serves these logits: float32 on a CPU, the kernel built."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32
            and cpu_sampling.available())


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` (``[g, vocab]``) with every token whose bit is 0 in ``bitmask`` (``[g,
    ceil(vocab / 32)]`` int32, token ``i`` at bit ``i % 32`` of word ``i // 32``) set to -inf."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :logits.shape[1]].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def _sample_random(logits: torch.Tensor, r: RandomDraws) -> torch.Tensor:
    """Each random row's draw (rows ``r.rows`` of the ``[n, vocab]`` logits) by inverse
    transform sampling over its filtered distribution: on a CPU by ``kernels.sampling``, which
    ranks only the tokens that can make a top-k/top-p cut and reads each row in cache (the
    same definition; a draw within rounding of a boundary may land on the neighbouring
    token); elsewhere, or without the kernel, by the torch ops below."""
    if _cpu_kernel_takes(logits):
        return cpu_sampling.sample_rows(logits.contiguous(), r.rows, r.temperature, r.top_k,
                                        r.top_p, r.min_p, r.uniforms)
    logits = logits[r.rows] / r.temperature.unsqueeze(1)
    if r.any_min_p:
        probs = torch.softmax(logits, dim=-1)
        threshold = r.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if (f := r.filter_rows) is not None:
        logits[f] = apply_top_k_top_p(logits[f], r.top_k[f], r.top_p[f])
    cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1)
    total = cdf[:, -1:]
    # strictly below the total, so the first entry above it is a token of non-zero probability
    target = torch.minimum(r.uniforms.unsqueeze(1) * total,
                           torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def apply_penalties(logits: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor, history: torch.Tensor, output_from: torch.Tensor,
                    ) -> torch.Tensor:
    """Penalise ``[num_seqs, vocab]`` logits by each row's token history (``[num_seqs, L]``,
    padded with -1; entries from ``output_from`` on are output tokens, the rest prompt)."""
    num_seqs, vocab = logits.shape
    padded = history.masked_fill(history < 0, vocab)  # padding lands in a discarded column
    is_output = torch.arange(history.shape[1], device=history.device) >= output_from.unsqueeze(1)
    counts = torch.zeros(num_seqs, vocab + 1, device=logits.device)
    counts.scatter_add_(1, padded, is_output.to(counts.dtype))
    counts = counts[:, :vocab]
    seen = torch.zeros(num_seqs, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, padded, True)
    rep = repetition.unsqueeze(1)
    logits = torch.where(seen[:, :vocab] & (rep != 1.0),
                         torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


# a row's top-k / nucleus is first looked for among its CANDIDATES most likely tokens: a topk of
# 512 of 49k logits costs ~1/8 of a full sort on a CPU
CANDIDATES = 512


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and outside its top-p nucleus: the
    smallest set of most likely tokens whose mass (within the top-k) reaches ``top_p``; one
    token always survives. logits ``[n, vocab]``; top_k ``[n]`` int64 (0: off); top_p ``[n]``.

    On a CPU the cut is found among each row's ``CANDIDATES`` most likely tokens when it lies
    there (top-k within them, or a nucleus of that much mass), and the other rows are sorted
    whole; on CUDA every row is sorted (fast there; choosing rows would cost a host sync)."""
    n, vocab = logits.shape
    if logits.is_cuda or vocab <= CANDIDATES:
        return _cut(logits, *logits.sort(dim=-1, descending=True), top_k, top_p, None)
    vals, order = logits.topk(CANDIDATES, dim=-1)
    window_k = (top_k > 0) & (top_k <= CANDIDATES)
    full_lse = logits.logsumexp(dim=-1)
    mass = (vals - full_lse.unsqueeze(1)).exp().sum(dim=-1)
    fits = (window_k | ((top_k == 0) & (mass >= top_p))).tolist()
    # top-k rows renormalise over their k survivors (all in the window), others over the vocab
    out = _cut(logits, vals, order, top_k, top_p, torch.where(window_k, torch.nan, full_lse))
    if not all(fits):
        rest = torch.tensor([i for i, f in enumerate(fits) if not f], dtype=torch.int64)
        sub = logits[rest]
        out[rest] = _cut(sub, *sub.sort(dim=-1, descending=True), top_k[rest], top_p[rest], None)
    return out


def _cut(logits: torch.Tensor, vals: torch.Tensor, order: torch.Tensor, top_k: torch.Tensor,
         top_p: torch.Tensor, lse: torch.Tensor | None) -> torch.Tensor:
    """``logits`` with everything masked but the survivors among ``vals`` (``[n, w]``, the
    most likely first, at vocabulary ids ``order``). ``lse``: each row's normaliser (NaN or
    None: the log-sum-exp of its top-k survivors)."""
    ranks = torch.arange(vals.shape[1], device=vals.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vals.shape[1]).unsqueeze(1)
    vals = vals.masked_fill(ranks >= k, float("-inf"))
    own = vals.logsumexp(dim=-1)
    norm = own if lse is None else torch.where(torch.isnan(lse), own, lse)
    probs = (vals - norm.unsqueeze(1)).exp()
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    mask = mass_before >= top_p.unsqueeze(1)
    mask[:, 0] = False
    return torch.full_like(logits, float("-inf")).scatter_(1, order, vals.masked_fill(mask, float("-inf")))
