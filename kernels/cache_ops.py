"""Triton cache kernels: write new K/V by slot mapping; gather / scatter whole blocks.

Cache layout as in ``kernels.reference``: one layer's K (or V) is ``[num_blocks, block_size,
num_kv_heads, head_dim]``; the whole cache ``[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]``. Source: vLLM's ``reshape_and_cache`` (slot-mapping scatter, slot
``-1`` skipped) and its block swap / copy ops, written as plain Triton copies.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._launch import check_devices, next_power_of_2


@triton.jit
def _write_kv_kernel(
    K, V, K_cache, V_cache, Slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_b, stride_s, stride_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slot_mapping + token).to(tl.int64)
    if slot >= 0:  # -1: a token with no slot (padding)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        dst = ((slot // BLOCK_SIZE) * stride_b + (slot % BLOCK_SIZE) * stride_s
               + offs_h[:, None] * stride_h + offs_d[None, :])
        k = tl.load(K + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                    mask=mask)
        tl.store(K_cache + dst, k, mask=mask)
        v = tl.load(V + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                    mask=mask)
        tl.store(V_cache + dst, v, mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V into their cache slots, in place.

    k, v: ``[num_tokens, num_kv_heads, head_dim]`` (head_dim contiguous); k_cache, v_cache:
    ``[num_blocks, block_size, num_kv_heads, head_dim]``, k's dtype, equal strides;
    slot_mapping: ``[num_tokens]`` int32/int64, ``block_id * block_size + offset``, or -1 to
    skip a token. Slots must be distinct and in range (not checked on the device).
    Same result as ``kernels.reference.write_kv_cache``. Raises ``ValueError`` on bad shapes.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit caches "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or not k.dtype == v.dtype == k_cache.dtype:
        raise ValueError("k_cache and v_cache need equal strides and k's dtype")
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("the head_dim axis must be contiguous")
    check_devices(k, v, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1])


@triton.jit
def _copy_blocks_kernel(
    Src, Dst, Block_ids, block_numel, src_outer, dst_outer,
    GATHER: tl.constexpr, BLOCK_E: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    outer = tl.program_id(1).to(tl.int64)
    block = tl.load(Block_ids + i).to(tl.int64)
    if GATHER:  # cache block `block` -> buffer slot i
        src = Src + outer * src_outer + block * block_numel
        dst = Dst + outer * dst_outer + i * block_numel
    else:  # buffer slot i -> cache block `block`
        src = Src + outer * src_outer + i * block_numel
        dst = Dst + outer * dst_outer + block * block_numel
    for e0 in range(0, block_numel, BLOCK_E):
        offs = e0 + tl.arange(0, BLOCK_E)
        mask = offs < block_numel
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy blocks ``block_ids`` of a paged cache into a new contiguous buffer.

    cache: ``[..., num_blocks, block_size, num_kv_heads, head_dim]``, contiguous (block axis
    fourth from the end: one layer's K, or the whole ``[num_layers, 2, ...]`` cache);
    block_ids: ``[n]`` int32/int64 on the cache's device, in range (not checked on the device).
    Returns ``[..., n, block_size, num_kv_heads, head_dim]`` in ``block_ids`` order, the
    cache's dtype and device. Same result as ``kernels.reference.gather_blocks``.
    """
    _check_blocks(cache, block_ids)
    shape = (*cache.shape[:-4], len(block_ids), *cache.shape[-3:])
    buffer = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    _launch_copy(cache, buffer, cache, block_ids, gather=True)
    return buffer


def scatter_blocks(buffer: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Inverse of ``gather_blocks``, in place: ``cache[..., block_ids[i], ...] =
    buffer[..., i, ...]``.

    buffer: ``[..., n, block_size, num_kv_heads, head_dim]``, contiguous, the cache's dtype;
    block_ids: ``[n]`` distinct ids. Raises ``ValueError`` on mismatched shapes.
    """
    _check_blocks(cache, block_ids)
    expected = (*cache.shape[:-4], len(block_ids), *cache.shape[-3:])
    if tuple(buffer.shape) != expected or buffer.dtype != cache.dtype:
        raise ValueError(f"buffer {tuple(buffer.shape)} {buffer.dtype}, expected {expected} "
                         f"{cache.dtype}")
    if not buffer.is_contiguous():
        raise ValueError("buffer must be contiguous")
    check_devices(cache, buffer)
    _launch_copy(buffer, cache, cache, block_ids, gather=False)


def _check_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    if cache.dim() < 4 or not cache.is_contiguous():
        raise ValueError("cache must be a contiguous [..., num_blocks, block_size, "
                         "num_kv_heads, head_dim] tensor")
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
    check_devices(cache, block_ids)


def _launch_copy(src: torch.Tensor, dst: torch.Tensor, cache: torch.Tensor,
                 block_ids: torch.Tensor, *, gather: bool) -> None:
    n = len(block_ids)
    outer = math.prod(cache.shape[:-4])
    if n == 0 or outer == 0:
        return
    block_numel = math.prod(cache.shape[-3:])
    cache_outer, buffer_outer = cache.shape[-4] * block_numel, n * block_numel
    src_outer, dst_outer = (cache_outer, buffer_outer) if gather else (buffer_outer, cache_outer)
    _copy_blocks_kernel[(n, outer)](
        src, dst, block_ids, block_numel, src_outer, dst_outer, GATHER=gather,
        BLOCK_E=min(1024, next_power_of_2(block_numel)))
