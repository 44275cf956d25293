"""Phi-3 and Phi-3.5 (Abdin et al. 2024): Llama with q/k/v and gate/up stored fused in the
checkpoint (``qkv_proj``, ``gate_up_proj``: our own layout, loaded as they are), an optional
sliding window on every layer (``sliding_window``; Phi-3-mini-4k's is 2047), and LongRoPE for
the 128k models (``rope_scaling`` ``longrope``, formerly ``su``). llama.cpp's ``phi3`` GGUF:
``attn_qkv`` and a fused ``ffn_up``, the LongRoPE factors as ``rope_factors_{long,short}``
tensors, ``phi3.attention.sliding_window`` 0 for none."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, RopeScaling
from ..model import LlamaForCausalLM
from .base import Architecture, Metadata, check_hf, gguf_common, hf_common


class Phi3ForCausalLM(LlamaForCausalLM):
    checkpoint_layer_tensors = ("input_layernorm.weight", "self_attn.qkv_proj.weight",
                                "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                                "mlp.gate_up_proj.weight", "mlp.down_proj.weight")


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    check_hf(raw, hidden_act="silu")
    raw = dict(raw)
    key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    scaling = raw.get(key) or {}
    if scaling.get("rope_type", scaling.get("type")) in ("su", "yarn"):
        # NOTE: transformers' Phi3Config renames both to longrope
        raw[key] = {**scaling, "rope_type": "longrope", "type": "longrope"}
    common = hf_common(raw, rms_norm_eps=1e-5, max_position_embeddings=4096, bos_token_id=1,
                       eos_token_id=32000)
    return ModelConfig(**common, architecture="phi3", sliding_window=raw.get("sliding_window"))


def config_from_gguf(meta: Metadata, tensors: dict[str, Any]) -> ModelConfig:
    common = gguf_common(meta, "phi3", tensors)
    rope_dims = meta("phi3.rope.dimension_count", common["head_dim"])
    if rope_dims != common["head_dim"]:
        raise ValueError(f"unsupported phi3.rope.dimension_count {rope_dims}: rotary over part "
                         f"of each head (head_dim {common['head_dim']})")
    if "rope_factors_long.weight" in tensors:
        common["rope_scaling"] = RopeScaling(
            "longrope", original_max_position_embeddings=meta(
                "phi3.rope.scaling.original_context_length", common["max_position_embeddings"]),
            attention_factor=meta("phi3.rope.scaling.attn_factor"),
            long_factor=tuple(float(f) for f in tensors["rope_factors_long.weight"]()),
            short_factor=tuple(float(f) for f in tensors["rope_factors_short.weight"]()))
    return ModelConfig(**common, architecture="phi3",
                       sliding_window=meta("phi3.attention.sliding_window") or None)


ARCHITECTURE = Architecture("phi3", Phi3ForCausalLM, config_from_hf, "phi3", config_from_gguf)
