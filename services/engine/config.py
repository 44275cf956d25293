"""Model and cache configuration shared by the loaders, the model and the KV cache.

``KVCacheLayout`` lives in ``kernels.kv_layout`` (the KV transport needs it without the engine);
it is re-exported here for the engine's callers."""
from __future__ import annotations

from dataclasses import dataclass

from kernels.kv_layout import KVCacheLayout

__all__ = ["KVCacheLayout", "ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Llama-architecture hyper-parameters, read from a GGUF header or a Hugging Face config.json.

    Field names follow Hugging Face's ``LlamaConfig`` so a checkpoint's config maps one to one.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int  # context length in tokens
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None

