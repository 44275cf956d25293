"""Llama 2/3.x, SmolLM and other ``LlamaForCausalLM`` checkpoints (Touvron et al. 2023): the
base family, whose model is ``services.engine.model.LlamaForCausalLM``. Llama 3.1+'s RoPE
scaling (``rope_type: llama3``) comes from ``config.json``, or from the ``rope_freqs`` tensor
of a GGUF file; llama.cpp stores q/k rows in its interleaved rotary order, put back here."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..config import ModelConfig
from ..model import LlamaForCausalLM
from .base import Architecture, Metadata, check_hf, gguf_common, hf_common


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    check_hf(raw, hidden_act="silu", attention_bias=False, mlp_bias=False)
    return ModelConfig(**hf_common(raw), architecture="llama")


def config_from_gguf(meta: Metadata, tensors: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**gguf_common(meta, "llama", tensors), architecture="llama")


def rotary_row_order(out_features: int, num_heads: int) -> np.ndarray:
    """Row permutation undoing llama.cpp's ``convert_hf_to_gguf.py`` ``permute`` of q/k
    (each head's rows as interleaved (even, odd) rotary pairs; Hugging Face keeps the first
    halves of the pairs, then the second halves): ``hf_rows = gguf_rows[order]``, int64
    ``[out_features]``."""
    head_dim = out_features // num_heads
    rows = np.arange(out_features).reshape(num_heads, head_dim // 2, 2)
    return rows.swapaxes(1, 2).reshape(-1)


def gguf_row_order(name: str, cfg: ModelConfig) -> np.ndarray | None:
    heads = {"self_attn.q_proj.weight": cfg.num_attention_heads,
             "self_attn.k_proj.weight": cfg.num_key_value_heads}
    for suffix, num_heads in heads.items():
        if name.endswith(suffix):
            return rotary_row_order(num_heads * cfg.head_dim, num_heads)
    return None


ARCHITECTURE = Architecture("llama", LlamaForCausalLM, config_from_hf, "llama", config_from_gguf,
                            gguf_row_order)
