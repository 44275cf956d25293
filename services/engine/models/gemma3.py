"""Gemma 3 text models (Gemma Team 2025; ``model_type: gemma3_text``, the 1B and the text part
that transformers saves as ``Gemma3ForCausalLM``): Gemma 2's layer with a per-head ``(1 + w)``
RMSNorm of q and k, no attention soft-capping, five local sliding-window layers per global one
(``sliding_window_pattern`` 6), and a RoPE per layer kind: global layers ``rope_theta`` (1e6,
with the configured scaling), local ones ``rope_local_base_freq`` (1e4) unscaled.

llama.cpp's ``gemma3`` GGUF: norm weights plus one (q/k norms too), the local rope base fixed at
10000, the pattern 6 unless ``gemma3.attention.sliding_window_pattern`` gives a period or one
flag per layer.
"""
from __future__ import annotations

from typing import Any

from ..config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from ..model import GemmaRMSNorm, QKNormAttention, RotaryEmbedding
from .base import Architecture, Metadata, check_hf, gguf_common, hf_common, hf_layer_types
from .gemma2 import Gemma2ForCausalLM, GemmaDecoderLayer, alternating, gguf_scalar, norm_offset


class GemmaQKNormAttention(QKNormAttention):
    norm_cls = GemmaRMSNorm


class Gemma3DecoderLayer(GemmaDecoderLayer):
    attention_cls = GemmaQKNormAttention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls = Gemma3DecoderLayer
    checkpoint_layer_tensors = (*Gemma2ForCausalLM.checkpoint_layer_tensors,
                                "self_attn.q_norm.weight", "self_attn.k_norm.weight")

    def rope_for_layer(self, layer: int) -> RotaryEmbedding:
        cfg = self.config
        if cfg.layer_window(layer) is not None:
            return self._rope(cfg.rope_local_theta or 10000.0, None)
        return super().rope_for_layer(layer)


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    if raw.get("text_config") is not None:
        raise ValueError("unsupported model_type 'gemma3' with a vision tower: only text-only "
                         "Gemma 3 checkpoints (model_type 'gemma3_text') are supported")
    check_hf(raw, hidden_activation="gelu_pytorch_tanh", attention_bias=False,
             use_bidirectional_attention=False)
    # transformers >= 5: rope_parameters per layer kind; older: rope_theta, rope_local_base_freq
    rope = raw.get("rope_parameters") or {}
    local = rope.get(SLIDING_ATTENTION) or {}
    common = hf_common(raw, rope_params=rope.get("full_attention"), rope_theta=1_000_000.0,
                       max_position_embeddings=131_072, tie_word_embeddings=True,
                       bos_token_id=2, eos_token_id=1)
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported rope scaling of Gemma 3's sliding layers: {local!r}")
    return ModelConfig(
        **common, architecture="gemma3_text", hidden_act="gelu_pytorch_tanh",
        rope_local_theta=float(local.get("rope_theta", raw.get("rope_local_base_freq", 10000.0))),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 256),
        attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        sliding_window=raw.get("sliding_window", 4096),
        layer_types=hf_layer_types(raw, common["num_hidden_layers"],
                                   alternating(raw.get("sliding_window_pattern", 6))))


def config_from_gguf(meta: Metadata, tensors: dict[str, Any]) -> ModelConfig:
    common = gguf_common(meta, "gemma3", tensors)
    layers = common["num_hidden_layers"]
    pattern = meta("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, int):  # llama.cpp: an int period, or one bool per layer (sliding)
        types = tuple(alternating(pattern)(i) for i in range(layers))
    elif len(pattern) == layers:
        types = tuple(SLIDING_ATTENTION if p else FULL_ATTENTION for p in pattern)
    else:
        raise ValueError(f"gemma3.attention.sliding_window_pattern: {len(pattern)} entries for "
                         f"{layers} layers")
    return ModelConfig(
        **common, architecture="gemma3_text", hidden_act="gelu_pytorch_tanh",
        rope_local_theta=10000.0, query_pre_attn_scalar=gguf_scalar(common, num_layers_27b=62),
        final_logit_softcapping=meta("gemma3.final_logit_softcapping"),
        sliding_window=meta("gemma3.attention.sliding_window", 4096), layer_types=types)


ARCHITECTURE = Architecture("gemma3_text", Gemma3ForCausalLM, config_from_hf, "gemma3",
                            config_from_gguf, gguf_offset=norm_offset)
