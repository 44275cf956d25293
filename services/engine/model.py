"""Llama-architecture decoder in torch (Touvron et al. 2023; Hugging Face ``LlamaForCausalLM``).

RMSNorm, rotary position embeddings (RoFormer, Su et al. 2021; Hugging Face's rotate-half
layout), grouped-query attention over the paged KV cache, SwiGLU MLP, optional tied LM head.
The forward pass takes a flattened ragged batch (``[num_tokens]``), never a padded one.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention, write_kv_cache
from .config import ModelConfig

Device = torch.device | str | None
RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [num_tokens, 1, head_dim]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
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
        cpu = torch.device("cpu")  # NOTE: real tables even when the weights are on meta
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu)
                                   .float() / head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=cpu), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos and sin at each token's position, ``[num_tokens, 1, head_dim]`` in ``dtype``:
        gathered once per forward pass and shared by every layer."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))

    @staticmethod
    def apply(tables: RopeTables, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (``[num_tokens, num_heads, head_dim]``) by ``tables`` (``tables()``)."""
        cos, sin = tables
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, device: Device = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q, bias=False, device=device)
        self.k_proj = nn.Linear(cfg.hidden_size, kv, bias=False, device=device)
        self.v_proj = nn.Linear(cfg.hidden_size, kv, bias=False, device=device)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False, device=device)
        self.rope = rope
        self.qkv_proj: nn.Module | None = None  # fused q/k/v (quantized path), see fuse_qkv

    def fuse_qkv(self, qkv_proj: nn.Module) -> None:
        """Replace q/k/v_proj by one module whose output rows are q's, then k's, then v's."""
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = qkv_proj

    def _qkv(self, x: torch.Tensor, rope: RopeTables,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q ``[t, heads, head_dim]``, rotated k and v ``[t, kv_heads, head_dim]``."""
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is None:
            q = RotaryEmbedding.apply(rope, self.q_proj(x).reshape(t, h, d))
            k = RotaryEmbedding.apply(rope, self.k_proj(x).reshape(t, kvh, d))
            return q, k, self.v_proj(x).reshape(t, kvh, d)
        # fused: q and k heads rotated in one pass (fewer ops per layer at small batches)
        qkv = self.qkv_proj(x).reshape(t, h + 2 * kvh, d)
        qk = RotaryEmbedding.apply(rope, qkv[:, :h + kvh])
        return qk[:, :h], qk[:, h:], qkv[:, h + kvh:]

    def forward(
        self, x: torch.Tensor, rope: RopeTables, kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x: ``[num_tokens, hidden]``; rope: ``RotaryEmbedding.tables`` of the tokens'
        positions; kv_cache: ``[2, num_blocks, block_size, kv_heads, head_dim]``."""
        t = x.shape[0]
        q, k, v = self._qkv(x, rope)
        write_kv_cache(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        o = paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        hidden, ffn = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(hidden, ffn, bias=False, device=device)
        self.up_proj = nn.Linear(hidden, ffn, bias=False, device=device)
        self.down_proj = nn.Linear(ffn, hidden, bias=False, device=device)
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
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, device: Device = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.self_attn = Attention(cfg, rope, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.mlp = MLP(cfg, device)

    def forward(self, x, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


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
    """State-dict names match Hugging Face's, so loader output loads with ``load_state_dict``.

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
        x = self.model.embed_tokens(input_ids)
        rope = self.model.layers[0].self_attn.rope.tables(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, kv_cache[i], meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab_size]`` float32 logits."""
        return self.lm_head(hidden).float()
