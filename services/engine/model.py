"""The decoder's shared building blocks, and Llama (Touvron et al. 2023; Hugging Face
``LlamaForCausalLM``), the family every other architecture varies (``services.engine.models``).

RMSNorm, rotary position embeddings (``rotary.py``), grouped-query attention over the paged KV
cache (optionally windowed and soft-capped), a gated MLP (SwiGLU or GeGLU), optional tied LM
head. The forward pass takes a flattened ragged batch (``[num_tokens]``), never a padded one.

A layer is few launches: q/k/v and gate/up are one matmul each (``qkv_proj``, ``gate_up_proj``;
Hugging Face checkpoints are fused on load by ``fuse_projections``), and the elementwise steps
are fused (``layer_ops``: residual add + RMSNorm, rotary + KV cache write, activation-and-
multiply): one kernel each on CUDA, the exact torch ops of Hugging Face's models elsewhere.

An architecture that differs subclasses what differs: a layer's ``attention_cls`` / ``norm_cls``,
the model's ``layer_cls``, ``embed``, ``rope_for_layer`` or ``compute_logits``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import layer_ops
from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .rotary import RotaryEmbedding

__all__ = ["Attention", "DecoderLayer", "DecoderModel", "GemmaRMSNorm", "LlamaForCausalLM",
           "MLP", "QKNormAttention", "RMSNorm", "RotaryEmbedding", "fuse_projections"]

Device = torch.device | str | None


class RMSNorm(nn.Module):
    """Hugging Face's ``LlamaRMSNorm``: normalised in float32, cast back, times ``weight``."""

    unit_offset = False  # Gemma's (1 + weight) form (GemmaRMSNorm)

    def __init__(self, dim: int, eps: float, device: Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, dim] -> [num_tokens, dim]`` in x's dtype."""
        return layer_ops.add_rms_norm(None, x, self.weight, self.eps, self.unit_offset)

    def add_forward(self, x: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
        """``residual += x`` in place (x None: nothing added), then the norm of ``residual``."""
        return layer_ops.add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)


class GemmaRMSNorm(RMSNorm):
    """Hugging Face's ``Gemma2RMSNorm``: times ``1 + weight``, multiplied in float32 before the
    cast (a zero weight is the identity scale)."""

    unit_offset = True


class Attention(nn.Module):
    """Grouped-query attention of layer ``layer``: fused q/k/v projection (with a bias where
    ``attention_bias``), rotary, paged attention (windowed on the config's sliding layers,
    soft-capped where ``attn_logit_softcapping``), output projection."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding,
                 device: Device = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.sliding_window = cfg.layer_window(layer)
        self.softcap = cfg.attn_logit_softcapping
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # output rows: q's, then k's, then v's (fuse_projections)
        self.qkv_proj: nn.Module = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.attention_bias,
                                             device=device)
        self.o_proj: nn.Module = nn.Linear(q, cfg.hidden_size, bias=False, device=device)
        self.rope = rope

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, hidden] -> [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]``."""
        return self.qkv_proj(x)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """x: ``[num_tokens, hidden]``; positions: ``[num_tokens]`` int64; kv_cache: ``[2,
        num_blocks, block_size, kv_heads, head_dim]``. Writes this step's K/V into the cache."""
        q = layer_ops.rope_write_kv(self.project(x), positions, self.rope.cos, self.rope.sin,
                                    kv_cache[0], kv_cache[1], meta.slot_mapping,
                                    self.num_heads, self.num_kv_heads)
        o = paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window,
                            self.softcap)
        return self.o_proj(o.reshape(x.shape[0], -1))


class QKNormAttention(Attention):
    """``Attention`` with a per-head RMSNorm of q and k before the rotary embedding (Qwen3's and
    Gemma 3's ``q_norm`` / ``k_norm``, of ``norm_cls``)."""

    norm_cls: type[RMSNorm] = RMSNorm

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding,
                 device: Device = None) -> None:
        super().__init__(cfg, layer, rope, device)
        self.q_norm = self.norm_cls(cfg.head_dim, cfg.rms_norm_eps, device)
        self.k_norm = self.norm_cls(cfg.head_dim, cfg.rms_norm_eps, device)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        qkv = super().project(x)
        layer_ops.qk_norm(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                          self.num_heads, self.num_kv_heads, self.q_norm.unit_offset)
        return qkv


# config.json's hidden_act -> the gated MLP's fused activation-and-multiply
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": layer_ops.silu_mul,  # SwiGLU (Shazeer 2020)
    "gelu_pytorch_tanh": layer_ops.gelu_tanh_mul,  # GeGLU, tanh-approximated GELU
}


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act: {cfg.hidden_act!r} is not one of {', '.join(ACTIVATIONS)}")
        hidden, ffn = cfg.hidden_size, cfg.intermediate_size
        # output rows: gate's, then up's (fuse_projections)
        self.gate_up_proj: nn.Module = nn.Linear(hidden, 2 * ffn, bias=False, device=device)
        self.down_proj: nn.Module = nn.Linear(ffn, hidden, bias=False, device=device)
        self.act_mul = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Llama's pre-norm layer: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    attention_cls: type[Attention] = Attention
    norm_cls: type[RMSNorm] = RMSNorm

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding,
                 device: Device = None) -> None:
        super().__init__()
        self.input_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.self_attn = self.attention_cls(cfg, layer, rope, device)
        self.post_attention_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.mlp = MLP(cfg, device)

    def forward(self, x: torch.Tensor | None, residual: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: the previous layer's output (None for the first layer), added to ``residual``
        (``[num_tokens, hidden]``, updated in place); returns this layer's MLP output, which
        the next layer (or the final norm) adds."""
        h = self.input_layernorm.add_forward(x, residual)
        a = self.self_attn(h, positions, kv_cache, meta)
        return self.mlp(self.post_attention_layernorm.add_forward(a, residual))


class DecoderModel(nn.Module):
    """The ``model.`` part of a checkpoint: ``embed_tokens``, ``layers``, final ``norm``."""

    def __init__(self, cfg: ModelConfig, layer_cls: type[nn.Module], norm_cls: type[RMSNorm],
                 rope_for_layer: Callable[[int], RotaryEmbedding], device: Device = None) -> None:
        super().__init__()
        # NOTE: on meta, skip the embedding's normal_ init: it runs torch._refs (imports dynamo)
        empty = (torch.empty(cfg.vocab_size, cfg.hidden_size, device=device)
                 if torch.device(device or "cpu").type == "meta" else None)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=empty,
                                         device=device)
        self.layers = nn.ModuleList(layer_cls(cfg, i, rope_for_layer(i), device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps, device)


class LlamaForCausalLM(nn.Module):
    """Parameter names are Hugging Face's except the fused ``qkv_proj`` / ``gate_up_proj``:
    load a Hugging Face state dict with ``fuse_projections`` first.

    ``device="meta"``: weights without storage or initialisation, for ``load_state_dict(...,
    assign=True)`` (the rotary tables are always built on CPU). Not a ``torch.device("meta")``
    context: entering one imports ``torch._dynamo`` (seconds of a worker's start).
    """

    layer_cls: type[nn.Module] = DecoderLayer
    norm_cls: type[RMSNorm] = RMSNorm
    # one layer's tensors as a Hugging Face checkpoint names them (before fuse_projections)
    checkpoint_layer_tensors: tuple[str, ...] = (
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
        "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")

    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        self.config = cfg
        self._ropes: dict[tuple, RotaryEmbedding] = {}
        self.model = DecoderModel(cfg, self.layer_cls, self.norm_cls, self.rope_for_layer, device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # the same forward pass in fused C calls, set where it runs (quantized.assemble_quantized)
        self.fused_forward: Callable[..., torch.Tensor] | None = None

    def rope_for_layer(self, layer: int) -> RotaryEmbedding:
        """The rotary tables layer ``layer`` uses (one per distinct setting, shared)."""
        cfg = self.config
        return self._rope(cfg.rope_theta, cfg.rope_scaling)

    def _rope(self, theta: float, scaling) -> RotaryEmbedding:
        key = (theta, scaling)
        if key not in self._ropes:
            cfg = self.config
            self._ropes[key] = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, theta,
                                               scaling)
        return self._ropes[key]

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig) -> set[str]:
        """Names of the tensors a Hugging Face checkpoint with ``cfg`` must hold, no more."""
        keys = {"model.embed_tokens.weight", "model.norm.weight"}
        if not cfg.tie_word_embeddings:
            keys.add("lm_head.weight")
        layer = [*cls.checkpoint_layer_tensors]
        if cfg.attention_bias:
            layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
        for i in range(cfg.num_hidden_layers):
            keys.update(f"model.layers.{i}.{name}" for name in layer)
        return keys

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[num_tokens]`` int64 -> the residual stream ``[num_tokens, hidden]`` (a new tensor)."""
        return self.model.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: ``[num_tokens]`` int64; kv_cache:
        ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``. Returns hidden states
        ``[num_tokens, hidden]``."""
        if self.fused_forward is not None:
            return self.fused_forward(input_ids, positions, kv_cache, meta)
        residual = self.embed(input_ids)  # the residual stream, updated in place
        x = None
        for i, layer in enumerate(self.model.layers):
            x = layer(x, residual, positions, kv_cache[i], meta)
        return self.model.norm.add_forward(x, residual)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab_size]`` float32 logits, written into ``out`` if given
        (``[n, vocab_size]`` float32: a CUDA graph's static output)."""
        logits = self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)


# Hugging Face projections stacked into one of ours, in output-row order (vLLM's
# ``stacked_params_mapping``)
STACKED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_projections(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face-named state dict with each layer's q/k/v and gate/up weights (and
    biases) stacked into ``qkv_proj`` / ``gate_up_proj`` (concatenated along the output rows;
    the inputs are dropped from the dict as they are used, so at most one layer's worth is held
    twice). Checkpoints that store them fused (Phi-3) pass through. Raises ``ValueError``
    naming a projection whose parts are incomplete."""
    out = dict(state_dict)
    layers = {k.split(".self_attn.")[0] for k in state_dict if ".self_attn." in k}
    for prefix in sorted(layers):
        for fused, parts in STACKED_PROJECTIONS.items():
            for kind in ("weight", "bias"):
                names = [f"{prefix}.{p}.{kind}" for p in parts]
                present = [n in out for n in names]
                if not any(present):
                    continue
                if not all(present):
                    raise ValueError(f"checkpoint has {[n for n, p in zip(names, present) if p]} "
                                     f"but not {[n for n, p in zip(names, present) if not p]}")
                out[f"{prefix}.{fused}.{kind}"] = torch.cat([out.pop(n) for n in names])
    return out
