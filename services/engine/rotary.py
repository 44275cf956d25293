"""Rotary position embeddings (RoFormer, Su et al. 2021) and the RoPE variants checkpoints
configure, in Hugging Face's rotate-half layout.

``inv_freq`` computes each variant's inverse frequencies with the float32 operations of
transformers' ``modeling_rope_utils`` (so the float32 oracle stays token-exact):

- default: ``theta ** -(2i / d)``;
- ``linear`` (position interpolation, Chen et al. 2023): divided by ``factor``;
- ``llama3`` (Llama 3.1): low frequencies divided by ``factor``, a smooth ramp between
  ``low_freq_factor`` and ``high_freq_factor`` wavelengths;
- ``yarn`` (Peng et al. 2023): NTK-by-parts ramp between interpolation and extrapolation,
  cos/sin scaled by ``0.1 ln(factor) + 1`` (or the configured attention factor);
- ``longrope`` (Phi-3, Ding et al. 2024): per-frequency divisors, ``short_factor`` for positions
  below ``original_max_position_embeddings`` and ``long_factor`` from there on, cos/sin scaled
  by ``sqrt(1 + ln(factor) / ln(original))``. NOTE: transformers switches a whole sequence to
  the long factors once it grows past the original length (re-rotating nothing already
  cached); here each position uses the factors of its own range, so a token's rotation never
  depends on its batch or on how long its sequence grew;
- ``freq_factors``: a GGUF file's ``rope_freqs`` tensor (llama.cpp's Llama 3 form): divisors.

Dynamic NTK scaling recomputes frequencies as a sequence grows and is refused.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .config import RopeScaling

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "freq_factors")


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None,
             max_positions: int) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """``(inv_freq, long_inv_freq, attention_factor)``: ``[head_dim // 2]`` float32 inverse
    frequencies, the longrope ones from ``original_max_position_embeddings`` on (else None),
    and the factor cos/sin are scaled by. Raises ``ValueError`` naming an unsupported
    ``rope_type`` or a missing parameter."""
    cpu = torch.device("cpu")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu).float() / head_dim
    base = 1.0 / theta ** exponents
    kind = scaling.rope_type if scaling else "default"
    if kind == "default":
        return base, None, 1.0
    assert scaling is not None
    if kind in ("linear", "llama3") and scaling.factor is None:
        raise ValueError(f"rope scaling {kind!r}: factor is missing")
    if kind == "linear":
        return base / scaling.factor, None, 1.0
    if kind == "llama3":
        return _llama3(base, scaling), None, 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_positions)
    if kind == "longrope":
        return _longrope(exponents, theta, scaling, max_positions)
    if kind == "freq_factors":
        factors = torch.tensor(scaling.freq_factors, dtype=torch.float32)
        if factors.shape != base.shape:
            raise ValueError(f"rope_freqs: {factors.numel()} factors for head_dim {head_dim}")
        return base / factors, None, 1.0
    raise ValueError(f"rope_type: {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def _original(scaling: RopeScaling) -> int:
    if scaling.original_max_position_embeddings is None:
        raise ValueError(f"rope scaling {scaling.rope_type!r}: original_max_position_embeddings "
                         "is missing")
    return scaling.original_max_position_embeddings


def _llama3(base: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """transformers' ``_compute_llama3_parameters``."""
    old_context_len = _original(s)
    low_freq_wavelen = old_context_len / s.low_freq_factor
    high_freq_wavelen = old_context_len / s.high_freq_factor
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_freq_wavelen, base / s.factor, base)
    smooth = (old_context_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, theta: float, s: RopeScaling,
          max_positions: int) -> tuple[torch.Tensor, None, float]:
    """transformers' ``_compute_yarn_parameters``."""
    original = _original(s)
    factor = s.factor if s.factor is not None else max_positions / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = (get_mscale(factor, s.mscale) / get_mscale(factor, s.mscale_all_dim)
                            if s.mscale and s.mscale_all_dim else get_mscale(factor))

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast or 32), correction_dim(s.beta_slow or 1)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # NOTE: transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    freqs = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return freqs, None, float(attention_factor)


def _longrope(exponents: torch.Tensor, theta: float, s: RopeScaling,
              max_positions: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """transformers' ``_compute_longrope_parameters``, both factor sets."""
    original = _original(s)
    factor = s.factor if s.factor is not None else max_positions / original
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    half = exponents.numel()
    if len(s.short_factor) != half or len(s.long_factor) != half:
        raise ValueError(f"rope longrope: short_factor and long_factor need {half} entries")
    powers = theta ** exponents
    short = 1.0 / (torch.tensor(s.short_factor, dtype=torch.float32) * powers)
    long = 1.0 / (torch.tensor(s.long_factor, dtype=torch.float32) * powers)
    return short, long, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``: ``[max_positions, head_dim]``
    float32 (always real CPU tensors at construction, even when the weights are on meta), in
    the rotate-half layout (``cat(freqs, freqs)``), scaled by the variant's attention factor.
    Raises ``ValueError`` as ``inv_freq``."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: RopeScaling | None = None) -> None:
        super().__init__()
        freq, long_freq, attention_factor = inv_freq(head_dim, theta, scaling, max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32, device=torch.device("cpu"))
        freqs = torch.outer(positions, freq)
        if long_freq is not None:
            original = _original(scaling)  # type: ignore[arg-type]
            freqs[original:] = torch.outer(positions[original:], long_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
