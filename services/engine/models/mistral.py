"""Mistral (Jiang et al. 2023): Llama with sliding-window attention on every layer
(``sliding_window`` in ``config.json``; Mistral 7B v0.1's is 4096, later versions set none).
Every layer slides, so the KV blocks wholly before the window are freed as the sequence grows
(``BlockManager.free_blocks_outside_window``). llama.cpp converts Mistral to its ``llama``
architecture, so a Mistral GGUF file loads as Llama (without a window, as llama.cpp runs it)."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..model import LlamaForCausalLM
from .base import Architecture, check_hf, hf_common


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layers; the window comes from the config (``Attention.sliding_window``)."""


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    check_hf(raw, hidden_act="silu")
    if raw.get("layer_types"):
        raise ValueError("unsupported config.json layer_types for model_type 'mistral' "
                         "(alternating attention is Ministral's)")
    # NOTE: transformers' MistralConfig defaults sliding_window to 4096 when the key is absent
    window = raw.get("sliding_window", 4096)
    return ModelConfig(**hf_common(raw, max_position_embeddings=4096 * 32, bos_token_id=1,
                                   eos_token_id=2),
                       architecture="mistral", sliding_window=window)


ARCHITECTURE = Architecture("mistral", MistralForCausalLM, config_from_hf)
