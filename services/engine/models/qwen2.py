"""Qwen2 and Qwen2.5 (Yang et al. 2024): Llama with a bias on the q/k/v projections (none on
the output projection). ``use_sliding_window`` (off in every released checkpoint) makes layers
from ``max_window_layers`` on slide. llama.cpp's ``qwen2`` GGUF keeps Hugging Face's rotary
row order and stores the biases as ``attn_{q,k,v}.bias``."""
from __future__ import annotations

from typing import Any

from ..config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from ..model import LlamaForCausalLM
from .base import Architecture, Metadata, check_hf, gguf_common, hf_common, hf_layer_types


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama's layers; the q/k/v bias comes from the config (``attention_bias``)."""


def qwen_window(raw: dict[str, Any]) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` of a Qwen2/Qwen3 config.json (transformers'
    ``Qwen2Config``: sliding layers only with ``use_sliding_window``, from
    ``max_window_layers`` on)."""
    window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window") else None
    if window is None:
        return {}
    first = raw.get("max_window_layers", 28)
    types = hf_layer_types(raw, raw["num_hidden_layers"],
                           lambda i: SLIDING_ATTENTION if i >= first else FULL_ATTENTION)
    return {"sliding_window": window, "layer_types": types}


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    check_hf(raw, hidden_act="silu")
    return ModelConfig(**hf_common(raw, max_position_embeddings=32768), architecture="qwen2",
                       attention_bias=True, **qwen_window(raw))


def config_from_gguf(meta: Metadata, tensors: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**gguf_common(meta, "qwen2", tensors), architecture="qwen2",
                       attention_bias=True)


ARCHITECTURE = Architecture("qwen2", Qwen2ForCausalLM, config_from_hf, "qwen2", config_from_gguf)
