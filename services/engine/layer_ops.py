"""A decoder layer's fused elementwise steps, dispatched by device as ``attention.py`` does:
CUDA tensors run ``kernels.layer_ops`` (Triton, one launch each); others the torch references
of ``kernels.reference``, which round exactly as Hugging Face's Llama does (the float32 oracle
stays token-exact). There is no flag: the device of the tensors decides.

- ``add_rms_norm(x, residual, weight, eps, unit_offset=False)``: ``residual += x`` in place
  (x None: nothing added), returns ``weight * rms_norm(residual)`` (``unit_offset``: Gemma's
  ``(1 + weight)``, multiplied in float32); ``[num_tokens, hidden]``.
- ``qk_norm(qkv, q_weight, k_weight, eps, num_heads, num_kv_heads, unit_offset=False)``:
  per-head RMSNorm of the fused projection's q and k heads, in place (Qwen3, Gemma 3).
- ``rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
  num_kv_heads)``: rotary of q and k from the fused projection's output, k and v written into
  the paged cache; returns q ``[num_tokens, num_heads, head_dim]``.
- ``silu_mul(gate_up)``: ``silu(gate) * up``, ``[num_tokens, 2 * ffn] -> [num_tokens, ffn]``;
  ``gelu_tanh_mul(gate_up)`` the same with tanh-approximated GELU (GeGLU, Gemma).
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch

from kernels import reference

from .attention import _require_triton


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, unit_offset: bool = False) -> torch.Tensor:
    return _ops(residual).add_rms_norm(x, residual, weight, eps, unit_offset)


def qk_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
            num_heads: int, num_kv_heads: int, unit_offset: bool = False) -> None:
    _ops(qkv).qk_norm(qkv, q_weight, k_weight, eps, num_heads, num_kv_heads, unit_offset)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    return _ops(qkv).rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping,
                                   num_heads, num_kv_heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _ops(gate_up).silu_mul(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _ops(gate_up).gelu_tanh_mul(gate_up)


def _ops(t: torch.Tensor) -> ModuleType:
    return _triton_layer_ops() if t.is_cuda else reference


@functools.cache
def _triton_layer_ops() -> ModuleType:
    """``kernels.layer_ops``, imported on first CUDA use (triton is optional)."""
    _require_triton()
    import kernels.layer_ops

    return kernels.layer_ops
