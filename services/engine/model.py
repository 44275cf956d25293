"""Llama-architecture decoder in torch (Touvron et al. 2023; Hugging Face ``LlamaForCausalLM``).

RMSNorm, rotary position embeddings (RoFormer, Su et al. 2021; Hugging Face's rotate-half
layout), grouped-query attention over the paged KV cache, SwiGLU MLP, optional tied LM head.
The forward pass takes a flattened ragged batch (``[num_tokens]``), never a padded one.

A layer is few launches: q/k/v and gate/up are one matmul each (``qkv_proj``, ``gate_up_proj``;
Hugging Face checkpoints are fused on load by ``fuse_projections``), and the elementwise steps
are fused (``layer_ops``: residual add + RMSNorm, rotary + KV cache write, SiLU-and-multiply):
one kernel each on CUDA, the exact torch ops of Hugging Face's model elsewhere.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels import reference

from . import layer_ops
from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig

Device = torch.device | str | None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised in float32 and cast back, as Hugging Face's LlamaRMSNorm does."""
        return reference.rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``: ``[max_positions, head_dim]``
    float32 (always real CPU tensors at construction, even when the weights are on meta)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        cpu = torch.device("cpu")
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu)
                                   .float() / head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=cpu), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, device: Device = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # output rows: q's, then k's, then v's (fuse_projections)
        self.qkv_proj: nn.Module = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=False, device=device)
        self.o_proj: nn.Module = nn.Linear(q, cfg.hidden_size, bias=False, device=device)
        self.rope = rope

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """x: ``[num_tokens, hidden]``; positions: ``[num_tokens]`` int64; kv_cache: ``[2,
        num_blocks, block_size, kv_heads, head_dim]``. Writes this step's K/V into the cache."""
        q = layer_ops.rope_write_kv(self.qkv_proj(x), positions, self.rope.cos, self.rope.sin,
                                    kv_cache[0], kv_cache[1], meta.slot_mapping,
                                    self.num_heads, self.num_kv_heads)
        o = paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        hidden, ffn = cfg.hidden_size, cfg.intermediate_size
        # output rows: gate's, then up's (fuse_projections)
        self.gate_up_proj: nn.Module = nn.Linear(hidden, 2 * ffn, bias=False, device=device)
        self.down_proj: nn.Module = nn.Linear(ffn, hidden, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(layer_ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, device: Device = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.self_attn = Attention(cfg, rope, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.mlp = MLP(cfg, device)

    def forward(self, x: torch.Tensor | None, residual: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: the previous layer's MLP output (None for the first layer), added to
        ``residual`` (``[num_tokens, hidden]``, updated in place); returns this layer's MLP
        output, which the next layer (or the final norm) adds."""
        norm = self.input_layernorm
        h = layer_ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        a = self.self_attn(h, positions, kv_cache, meta)
        norm = self.post_attention_layernorm
        return self.mlp(layer_ops.add_rms_norm(a, residual, norm.weight, norm.eps))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        # NOTE: on meta, skip the embedding's normal_ init: it runs torch._refs (imports dynamo)
        empty = (torch.empty(cfg.vocab_size, cfg.hidden_size, device=device)
                 if torch.device(device or "cpu").type == "meta" else None)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=empty,
                                         device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope, device)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)


class LlamaForCausalLM(nn.Module):
    """Parameter names are Hugging Face's except the fused ``qkv_proj`` / ``gate_up_proj``:
    load a Hugging Face state dict with ``fuse_projections`` first.

    ``device="meta"``: weights without storage or initialisation, for ``load_state_dict(...,
    assign=True)`` (the rotary tables are always built on CPU). Not a ``torch.device("meta")``
    context: entering one imports ``torch._dynamo`` (seconds of a worker's start).
    """

    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # the same forward pass in fused C calls, set where it runs (quantized.assemble_quantized)
        self.fused_forward: Callable[..., torch.Tensor] | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: ``[num_tokens]`` int64; kv_cache:
        ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``. Returns hidden states
        ``[num_tokens, hidden]``."""
        if self.fused_forward is not None:
            return self.fused_forward(input_ids, positions, kv_cache, meta)
        residual = self.model.embed_tokens(input_ids)  # the residual stream, updated in place
        x = None
        for i, layer in enumerate(self.model.layers):
            x = layer(x, residual, positions, kv_cache[i], meta)
        norm = self.model.norm
        return layer_ops.add_rms_norm(x, residual, norm.weight, norm.eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab_size]`` float32 logits."""
        return self.lm_head(hidden).float()


# Hugging Face projections stacked into one of ours, in output-row order (vLLM's
# ``stacked_params_mapping``)
STACKED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_projections(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face-named state dict with each layer's q/k/v and gate/up weights stacked into
    ``qkv_proj`` / ``gate_up_proj`` (concatenated along the output rows; the inputs are dropped
    from the dict as they are used, so at most one layer's worth is held twice). Raises
    ``ValueError`` naming a projection whose parts are incomplete."""
    out = dict(state_dict)
    layers = {k.split(".self_attn.")[0] for k in state_dict if ".self_attn." in k}
    for prefix in sorted(layers):
        for fused, parts in STACKED_PROJECTIONS.items():
            names = [f"{prefix}.{p}.weight" for p in parts]
            present = [n in out for n in names]
            if not any(present):
                continue
            if not all(present):
                raise ValueError(f"checkpoint has {[n for n, p in zip(names, present) if p]} "
                                 f"but not {[n for n, p in zip(names, present) if not p]}")
            out[f"{prefix}.{fused}.weight"] = torch.cat([out.pop(n) for n in names])
    return out
