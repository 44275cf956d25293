"""Triton kernels for a decoder layer's elementwise steps, one launch each, computed in float32
with the roundings of the torch references in ``kernels.reference`` (Hugging Face's Llama):

- ``add_rms_norm``: the residual add and RMSNorm (Zhang and Sennrich, NeurIPS 2019) in one
  pass: ``residual += x`` (rounded to the model dtype), then ``weight * norm(residual)``
  normalised in float32 and rounded back, as ``LlamaRMSNorm`` does (``unit_offset``: times
  ``1 + weight`` in float32, then rounded, as ``Gemma2RMSNorm``). Replaces ~9 launches.
- ``qk_norm``: the per-head RMSNorm of q and k (Qwen3, Gemma 3) in place in the fused q/k/v
  projection's output, one program per (token, head).
- ``rope_write_kv``: rotary position embedding (Su et al. 2021, Hugging Face's rotate-half
  layout) of q, in place in the fused q/k/v projection's output, and of k, written with v
  straight into the paged KV cache by slot mapping (slot -1: skipped), reading cos/sin from
  the full tables by position. Replaces ~14 launches (rotations, concatenations, cache writes).
- ``silu_mul`` / ``gelu_tanh_mul``: SwiGLU's ``silu(gate) * up`` or GeGLU's ``gelu(gate) *
  up`` (tanh approximation) from the fused gate/up projection's output. Replaces 2-3 launches.

Products and sums are rounded to the model dtype where the references round them (bfloat16:
each product and sum; float32: the same, up to the compiler contracting a multiply-add), so
results agree with the references to the last bit or two, never more.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import check_devices, next_power_of_2


@triton.jit
def _normed(r, w, hidden, eps, out_dtype, UNIT_OFFSET: tl.constexpr):
    """RMSNorm of one row ``r`` (model dtype) with weight ``w``, rounded as the reference."""
    r32 = r.to(tl.float32)
    variance = tl.sum(r32 * r32, axis=0) / hidden
    normed32 = r32 * (1.0 / tl.sqrt(variance + eps))
    if UNIT_OFFSET:  # (x * (1 + w)) in float32, then rounded (Gemma)
        return (normed32 * (1.0 + w.to(tl.float32))).to(out_dtype)
    normed = normed32.to(r.dtype)
    return (w.to(tl.float32) * normed.to(tl.float32)).to(out_dtype)


@triton.jit
def _add_rms_norm_kernel(X, Residual, Weight, Out, stride_x, stride_r, stride_o, hidden, eps,
                         HAS_X: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
    if HAS_X:  # residual += x, rounded to the residual's dtype as torch's add rounds it
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
        r = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)
        tl.store(Residual + row * stride_r + offs, r, mask=mask)
    w = tl.load(Weight + offs, mask=mask, other=0.0)
    out = _normed(r, w, hidden, eps, Out.dtype.element_ty, UNIT_OFFSET)
    tl.store(Out + row * stride_o + offs, out, mask=mask)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, unit_offset: bool = False) -> torch.Tensor:
    """``residual += x`` in place (skipped when ``x`` is None), then return
    ``weight * rms_norm(residual)`` (``unit_offset``: ``(1 + weight)``, Gemma's form). x,
    residual: ``[num_tokens, hidden]`` (hidden contiguous), one dtype; weight: ``[hidden]``.
    Returns ``[num_tokens, hidden]`` in residual's dtype. Same result as
    ``kernels.reference.add_rms_norm``. Raises ``ValueError`` on bad shapes."""
    num_tokens, hidden = residual.shape
    if weight.shape != (hidden,) or (x is not None and x.shape != residual.shape):
        raise ValueError(f"x {None if x is None else tuple(x.shape)}, residual "
                         f"{tuple(residual.shape)}, weight {tuple(weight.shape)} do not fit")
    if residual.stride(1) != 1 or (x is not None and x.stride(1) != 1):
        raise ValueError("the hidden axis must be contiguous")
    check_devices(residual, weight, *([] if x is None else [x]))
    out = torch.empty_like(residual)
    if num_tokens:
        _add_rms_norm_kernel[(num_tokens,)](
            residual if x is None else x, residual, weight, out,
            residual.stride(0) if x is None else x.stride(0), residual.stride(0), out.stride(0),
            hidden, eps, HAS_X=x is not None, UNIT_OFFSET=unit_offset,
            BLOCK=next_power_of_2(hidden))
    return out


@triton.jit
def _qk_norm_kernel(QKV, Q_weight, K_weight, stride_t, eps, NUM_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < HEAD_DIM
    ptrs = QKV + token * stride_t + head * HEAD_DIM + offs
    x = tl.load(ptrs, mask=mask, other=0.0)
    if head < NUM_HEADS:
        w = tl.load(Q_weight + offs, mask=mask, other=0.0)
    else:
        w = tl.load(K_weight + offs, mask=mask, other=0.0)
    tl.store(ptrs, _normed(x, w, HEAD_DIM, eps, x.dtype, UNIT_OFFSET), mask=mask)


def qk_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
            num_heads: int, num_kv_heads: int, unit_offset: bool = False) -> None:
    """Per-head RMSNorm of the q and k heads of ``qkv`` (``[num_tokens, (num_heads + 2 *
    num_kv_heads) * head_dim]``, rows contiguous), in place; q_weight, k_weight:
    ``[head_dim]``. Same result as ``kernels.reference.qk_norm``. Raises ``ValueError`` on bad
    shapes."""
    num_tokens, width = qkv.shape
    head_dim = q_weight.shape[0]
    if width != (num_heads + 2 * num_kv_heads) * head_dim or k_weight.shape != q_weight.shape:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_heads} + 2 x {num_kv_heads} "
                         f"heads of the norms' head_dim {head_dim}")
    if qkv.stride(1) != 1:
        raise ValueError("qkv rows must be contiguous")
    check_devices(qkv, q_weight, k_weight)
    if num_tokens:
        _qk_norm_kernel[(num_tokens, num_heads + num_kv_heads)](
            qkv, q_weight, k_weight, qkv.stride(0), eps, NUM_HEADS=num_heads,
            HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), UNIT_OFFSET=unit_offset)


@triton.jit
def _rope_write_kv_kernel(QKV, Positions, Cos, Sin, K_cache, V_cache, Slot_mapping,
                          stride_t, stride_cos, stride_b, stride_s, stride_h,
                          NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                          HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    src = QKV + token * stride_t + head * (2 * HALF)
    lo = tl.load(src + offs, mask=mask, other=0.0)
    hi = tl.load(src + HALF + offs, mask=mask, other=0.0)
    dtype = lo.dtype
    if head < NUM_HEADS + NUM_KV_HEADS:  # q or k: rotate (cos/sin rounded to the dtype first)
        pos = tl.load(Positions + token).to(tl.int64)
        c = tl.load(Cos + pos * stride_cos + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
        s = tl.load(Sin + pos * stride_cos + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
        lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product rounded as torch rounds it
        new_lo = ((lo32 * c).to(dtype).to(tl.float32) - (hi32 * s).to(dtype).to(tl.float32)).to(dtype)
        new_hi = ((hi32 * c).to(dtype).to(tl.float32) + (lo32 * s).to(dtype).to(tl.float32)).to(dtype)
        lo, hi = new_lo, new_hi
    if head < NUM_HEADS:  # q: in place
        tl.store(src + offs, lo, mask=mask)
        tl.store(src + HALF + offs, hi, mask=mask)
    else:
        slot = tl.load(Slot_mapping + token).to(tl.int64)
        if slot >= 0:
            kv_head = (head - NUM_HEADS) % NUM_KV_HEADS
            dst = ((slot // BLOCK_SIZE) * stride_b + (slot % BLOCK_SIZE) * stride_s
                   + kv_head * stride_h)
            if head < NUM_HEADS + NUM_KV_HEADS:
                tl.store(K_cache + dst + offs, lo, mask=mask)
                tl.store(K_cache + dst + HALF + offs, hi, mask=mask)
            else:
                tl.store(V_cache + dst + offs, lo, mask=mask)
                tl.store(V_cache + dst + HALF + offs, hi, mask=mask)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Rotate q in place in ``qkv`` and write rotated k and v into the cache.

    qkv: ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]`` (q's heads, then k's, then
    v's; rows contiguous); positions: ``[num_tokens]`` int; cos, sin: ``[max_positions,
    head_dim]`` float32 tables; k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` in qkv's dtype, equal strides; slot_mapping: ``[num_tokens]`` int (-1: skip).
    Positions and slots must be in range (not checked on the device). Returns q, a
    ``[num_tokens, num_heads, head_dim]`` view of ``qkv``. Same result as
    ``kernels.reference.rope_write_kv``. Raises ``ValueError`` on bad shapes.
    """
    num_tokens, width = qkv.shape
    head_dim = k_cache.shape[3]
    if width != (num_heads + 2 * num_kv_heads) * head_dim or k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_heads} + 2 x {num_kv_heads} "
                         f"heads of the cache's head_dim {head_dim}")
    if head_dim % 2 or cos.shape != sin.shape or cos.shape[1] != head_dim:
        raise ValueError(f"cos/sin tables {tuple(cos.shape)} do not fit head_dim {head_dim}")
    if qkv.stride(1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("qkv rows and the caches' head_dim axis must be contiguous")
    if not qkv.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"dtypes differ: qkv {qkv.dtype}, cache {k_cache.dtype}")
    check_devices(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping)
    if num_tokens:
        half = head_dim // 2
        _rope_write_kv_kernel[(num_tokens, num_heads + 2 * num_kv_heads)](
            qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, qkv.stride(0),
            cos.stride(0), *k_cache.stride()[:3], NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_HALF=next_power_of_2(half),
            BLOCK_SIZE=k_cache.shape[1])
    return qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)


_SILU, _GELU_TANH = 0, 1
# NOTE: a global read inside @triton.jit must be a tl.constexpr on a GPU (the interpreter
# accepts a plain float, so only a GPU run catches it)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _act_mul_kernel(GateUp, Out, stride_g, stride_o, ffn, ACT: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ffn
    g = tl.load(GateUp + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(GateUp + row * stride_g + ffn + offs, mask=mask, other=0.0)
    g32 = g.to(tl.float32)
    if ACT == 0:  # silu
        act32 = g32 / (1.0 + tl.exp(-g32))
    else:  # gelu, tanh approximation; tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|)
        y = _SQRT_2_OVER_PI * (g32 + 0.044715 * g32 * g32 * g32)
        e = tl.exp(-2.0 * tl.abs(y))
        tanh = tl.where(y >= 0, 1.0, -1.0) * (1.0 - e) / (1.0 + e)
        act32 = 0.5 * g32 * (1.0 + tanh)
    act = act32.to(g.dtype)  # rounded as torch rounds it
    tl.store(Out + row * stride_o + offs, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype),
             mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` (``[num_tokens, 2 * ffn]``: gate's columns, then
    up's; rows contiguous) -> ``[num_tokens, ffn]`` in its dtype. Same result as
    ``kernels.reference.silu_mul``. Raises ``ValueError`` for an odd width."""
    return _act_mul(gate_up, _SILU)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate) * up`` (tanh approximation), shapes as ``silu_mul``. Same result as
    ``kernels.reference.gelu_tanh_mul`` to float32 rounding. Raises ``ValueError``."""
    return _act_mul(gate_up, _GELU_TANH)


def _act_mul(gate_up: torch.Tensor, act: int) -> torch.Tensor:
    num_tokens, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} must have an even, contiguous width")
    ffn = width // 2
    out = torch.empty((num_tokens, ffn), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = min(1024, next_power_of_2(ffn))
        _act_mul_kernel[(num_tokens, triton.cdiv(ffn, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), ffn, ACT=act, BLOCK=block)
    return out
