"""Gemma 2 (Gemma Team 2024): embeddings scaled by ``sqrt(hidden)``, RMSNorms of the form
``x * (1 + w)`` around both the attention and the MLP (pre and post norms), GeGLU MLP,
attention scale ``query_pre_attn_scalar ** -0.5``, attention and final logits soft-capped
(``c * tanh(x / c)``), local sliding-window layers alternating with global ones (even layers
slide). The LM head is tied to the embedding.

llama.cpp's ``gemma2`` GGUF stores every norm weight plus one (its RMSNorm multiplies by the
weight alone), taken off here, and gives no ``query_pre_attn_scalar``: like llama.cpp, the
27B model (46 layers) uses ``hidden / heads``, the others ``head_dim``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention import AttentionMetadata
from ..config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from ..model import MLP, Attention, Device, GemmaRMSNorm, LlamaForCausalLM, RotaryEmbedding
from .base import Architecture, Metadata, check_hf, gguf_common, hf_common, hf_layer_types


class GemmaDecoderLayer(nn.Module):
    """``h = x + post_attn_norm(attn(input_norm(x))); out = h + post_ffw_norm(mlp(pre_ffw_norm(h)))``."""

    attention_cls: type[Attention] = Attention

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding,
                 device: Device = None) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, device)
        self.self_attn = self.attention_cls(cfg, layer, rope, device)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, device)
        self.mlp = MLP(cfg, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, device)

    def forward(self, x: torch.Tensor | None, residual: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """As ``model.DecoderLayer.forward``: returns the normed MLP output the next layer adds."""
        h = self.input_layernorm.add_forward(x, residual)
        a = self.post_attention_layernorm(self.self_attn(h, positions, kv_cache, meta))
        h = self.pre_feedforward_layernorm.add_forward(a, residual)
        return self.post_feedforward_layernorm(self.mlp(h))


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm
    checkpoint_layer_tensors = (*LlamaForCausalLM.checkpoint_layer_tensors,
                                "pre_feedforward_layernorm.weight",
                                "post_feedforward_layernorm.weight")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings times ``sqrt(hidden)``, the scale rounded to their dtype first (as
        Hugging Face's ``Gemma2TextScaledWordEmbedding``)."""
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head's logits soft-capped (``c * tanh(x / c)``): in the fused C pass by the
        C kernel, in place (torch's three passes cost a third of a tiny model's step); in the
        module path by torch, as transformers computes them (the oracle). ``out``: as
        ``LlamaForCausalLM.compute_logits``'s."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None and self.fused_forward is not None and logits.dtype == torch.float32:
            from kernels import decode_ops

            logits = decode_ops.softcap_(logits.contiguous(), cap)
        elif cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if out is None else out.copy_(logits)


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    check_hf(raw, hidden_activation="gelu_pytorch_tanh", attention_bias=False)
    common = hf_common(raw, max_position_embeddings=8192, tie_word_embeddings=True,
                       bos_token_id=2, eos_token_id=1)
    return ModelConfig(
        **common, architecture="gemma2", hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 256),
        attn_logit_softcapping=raw.get("attn_logit_softcapping", 50.0),
        final_logit_softcapping=raw.get("final_logit_softcapping", 30.0),
        sliding_window=raw.get("sliding_window", 4096),
        layer_types=hf_layer_types(raw, common["num_hidden_layers"], alternating(2)))


def alternating(pattern: int):
    """Hugging Face's default ``layer_types`` for a pattern of ``pattern - 1`` sliding layers,
    then one global: layer ``i`` slides unless ``(i + 1) % pattern == 0``."""
    return lambda i: FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION


def gguf_scalar(cfg: dict[str, Any], num_layers_27b: int) -> float:
    """llama.cpp's attention scale choice for Gemma: ``hidden / heads`` for the 27B model
    (recognised by its layer count), ``head_dim`` otherwise."""
    if cfg["num_hidden_layers"] == num_layers_27b:
        return cfg["hidden_size"] / cfg["num_attention_heads"]
    return float(cfg["head_dim"])


def config_from_gguf(meta: Metadata, tensors: dict[str, Any]) -> ModelConfig:
    common = gguf_common(meta, "gemma2", tensors)
    return ModelConfig(
        **common, architecture="gemma2", hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=gguf_scalar(common, num_layers_27b=46),
        attn_logit_softcapping=meta("gemma2.attn_logit_softcapping"),
        final_logit_softcapping=meta("gemma2.final_logit_softcapping"),
        sliding_window=meta("gemma2.attention.sliding_window", 4096),
        layer_types=tuple(alternating(2)(i) for i in range(common["num_hidden_layers"])))


def norm_offset(name: str) -> float:
    """llama.cpp's converter adds 1 to every Gemma norm weight (``norm.weight`` names)."""
    return 1.0 if name.endswith("norm.weight") else 0.0


ARCHITECTURE = Architecture("gemma2", Gemma2ForCausalLM, config_from_hf, "gemma2",
                            config_from_gguf, gguf_offset=norm_offset)
