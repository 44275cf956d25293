"""Llama-architecture decoder in torch (Touvron et al. 2023; Hugging Face ``LlamaForCausalLM``).

RMSNorm, rotary position embeddings (RoFormer, Su et al. 2021; Hugging Face's rotate-half
layout), grouped-query attention over the paged KV cache, SwiGLU MLP, optional tied LM head.
The forward pass takes a flattened ragged batch (``[num_tokens]``), never a padded one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention, write_kv_cache
from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised in float32 and cast back, as Hugging Face's LlamaRMSNorm does."""
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``: ``[max_positions, head_dim]``."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (``[num_tokens, num_heads, head_dim]``) by each token's position."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.rope = rope
        self.qkv_proj: nn.Module | None = None  # fused q/k/v (quantized path), see fuse_qkv

    def fuse_qkv(self, qkv_proj: nn.Module) -> None:
        """Replace q/k/v_proj by one module whose output rows are q's, then k's, then v's."""
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = qkv_proj

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv = self.num_kv_heads * self.head_dim
        return self.qkv_proj(x).split([self.num_heads * self.head_dim, kv, kv], dim=-1)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x: ``[num_tokens, hidden]``; kv_cache: ``[2, num_blocks, block_size, kv_heads, head_dim]``."""
        t = x.shape[0]
        q, k, v = self._qkv(x)
        q = self.rope(positions, q.reshape(t, self.num_heads, self.head_dim))
        k = self.rope(positions, k.reshape(t, self.num_kv_heads, self.head_dim))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        write_kv_cache(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        o = paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # fused gate/up (quantized path)

    def fuse_gate_up(self, gate_up_proj: nn.Module) -> None:
        """Replace gate/up_proj by one module whose output rows are gate's, then up's."""
        del self.gate_proj, self.up_proj
        self.gate_up_proj = gate_up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """State-dict names match Hugging Face's, so loader output loads with ``load_state_dict``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: ``[num_tokens]`` int64; kv_cache:
        ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``. Returns hidden states
        ``[num_tokens, hidden]``."""
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, kv_cache[i], meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab_size]`` float32 logits."""
        return self.lm_head(hidden).float()
