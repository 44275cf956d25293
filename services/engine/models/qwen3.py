"""Qwen3 dense models (Qwen Team 2025): Llama with a per-head RMSNorm of q and k before the
rotary embedding (``q_norm`` / ``k_norm``), no q/k/v bias, an explicit ``head_dim``. llama.cpp's
``qwen3`` GGUF stores the norms as ``attn_{q,k}_norm`` and keeps Hugging Face's row order."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..model import DecoderLayer, LlamaForCausalLM, QKNormAttention
from .base import Architecture, Metadata, check_hf, gguf_common, hf_common
from .qwen2 import qwen_window


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = QKNormAttention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
    checkpoint_layer_tensors = (*LlamaForCausalLM.checkpoint_layer_tensors,
                                "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    check_hf(raw, hidden_act="silu", attention_bias=False)
    return ModelConfig(**hf_common(raw, max_position_embeddings=32768), architecture="qwen3",
                       **qwen_window(raw))


def config_from_gguf(meta: Metadata, tensors: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**gguf_common(meta, "qwen3", tensors), architecture="qwen3")


ARCHITECTURE = Architecture("qwen3", Qwen3ForCausalLM, config_from_hf, "qwen3", config_from_gguf)
