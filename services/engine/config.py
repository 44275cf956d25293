"""Model and cache configuration shared by the loaders, the model and the KV cache.

``KVCacheLayout`` lives in ``kernels.kv_layout`` (the KV transport needs it without the engine);
it is re-exported here for the engine's callers."""
from __future__ import annotations

from dataclasses import dataclass

from kernels.kv_layout import KVCacheLayout

__all__ = ["KVCacheLayout", "ModelConfig", "RopeScaling", "FULL_ATTENTION", "SLIDING_ATTENTION"]

# Hugging Face's ``layer_types`` values
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE variant other than the default: Hugging Face's ``rope_parameters`` (older
    checkpoints: ``rope_scaling``) with their key names, or a GGUF file's rope factors.
    ``services.engine.rotary`` turns it into inverse frequencies."""

    rope_type: str  # "linear", "llama3", "yarn", "longrope", or "freq_factors" (GGUF rope_freqs)
    factor: float | None = None  # linear, llama3 (required); yarn, longrope (default: max / original)
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn, longrope: scales cos and sin
    long_factor: tuple[float, ...] = ()  # longrope: divisors of each frequency past the original
    short_factor: tuple[float, ...] = ()  # longrope: ... and within it
    freq_factors: tuple[float, ...] = ()  # llama.cpp's rope_freqs tensor: divisors of each frequency


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's hyper-parameters, read from a GGUF header or a Hugging Face config.json.

    Field names follow Hugging Face's configs (``LlamaConfig``, ``Gemma2Config``, ...) so a
    checkpoint's config maps one to one; the fields after ``eos_token_id`` default to Llama's
    values and are set by the architectures that differ (``services.engine.models``).
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
    architecture: str = "llama"  # Hugging Face's model_type (services.engine.models)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh"
    attention_bias: bool = False  # q/k/v projections with a bias (Qwen2)
    rope_scaling: RopeScaling | None = None
    rope_local_theta: float | None = None  # sliding layers' rope base (Gemma 3), else rope_theta
    sliding_window: int | None = None  # tokens a sliding layer's query sees, itself included
    layer_types: tuple[str, ...] = ()  # FULL_ATTENTION / SLIDING_ATTENTION per layer; (): all
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the logits (Gemma 2)
    # every id that ends a sequence, eos_token_id first: config.json's and
    # generation_config.json's eos lists (Llama 3's <|eot_id|>, Gemma's <end_of_turn>), a GGUF
    # file's eos, eot and eom ids
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types: {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        bad = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if bad:
            raise ValueError(f"layer_types: unsupported {sorted(bad)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window: must be >= 1, got {self.sliding_window}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` in tokens, or None where it attends to all."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window when every layer slides (Mistral; blocks before it can be freed), else
        None (no window, or some layers attend to the whole context)."""
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else None

    @property
    def mixed_sliding_window(self) -> int | None:
        """The sliding layers' window when the others attend to the whole context (Gemma 2/3:
        every block stays, but the sliding layers never read those before their window),
        else None."""
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        return max(windows - {None}) if None in windows and len(windows) > 1 else None
