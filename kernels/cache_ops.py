"""Triton cache kernels: write new K/V by slot mapping; gather / scatter / copy whole blocks.

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
    Src, Dst, Src_ids, Dst_ids, block_numel, src_outer, dst_outer,
    SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # program (i, outer): block Src_ids[i] (or slot i) -> block Dst_ids[i] (or slot i)
    i = tl.program_id(0).to(tl.int64)
    outer = tl.program_id(1).to(tl.int64)
    src_block = i
    if SRC_INDEXED:
        src_block = tl.load(Src_ids + i).to(tl.int64)
    dst_block = i
    if DST_INDEXED:
        dst_block = tl.load(Dst_ids + i).to(tl.int64)
    src = Src + outer * src_outer + src_block * block_numel
    dst = Dst + outer * dst_outer + dst_block * block_numel
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
    _launch_copy(cache, buffer, block_ids, None, cache.shape[-4], len(block_ids))
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
    _launch_copy(buffer, cache, None, block_ids, len(block_ids), cache.shape[-4])


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor,
                dst_ids: torch.Tensor) -> None:
    """Copy block ``src_ids[i]`` of one paged cache into block ``dst_ids[i]`` of another, in
    place, in one pass (no staging buffer): ``dst[..., dst_ids[i], ...] = src[..., src_ids[i],
    ...]``. vLLM's ``copy_blocks`` between two caches; the KV handoff's device path.

    src, dst: contiguous ``[..., num_blocks, block_size, num_kv_heads, head_dim]``, equal but
    for ``num_blocks``, one dtype, one device (``dst`` may be another process's cache opened by
    CUDA IPC); src_ids, dst_ids: ``[n]`` int32/int64 on that device, in range (not checked on
    the device), ``dst_ids`` distinct. Raises ``ValueError`` on mismatched shapes or devices.
    """
    _check_blocks(src, src_ids)
    _check_blocks(dst, dst_ids)
    if src.shape[:-4] != dst.shape[:-4] or src.shape[-3:] != dst.shape[-3:] \
            or src.dtype != dst.dtype or src_ids.shape != dst_ids.shape:
        raise ValueError(f"cannot copy blocks of {tuple(src.shape)} {src.dtype} into "
                         f"{tuple(dst.shape)} {dst.dtype} with {len(src_ids)} source and "
                         f"{len(dst_ids)} destination ids")
    check_devices(src, dst)
    _launch_copy(src, dst, src_ids, dst_ids, src.shape[-4], dst.shape[-4])


def _check_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    if cache.dim() < 4 or not cache.is_contiguous():
        raise ValueError("cache must be a contiguous [..., num_blocks, block_size, "
                         "num_kv_heads, head_dim] tensor")
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
    check_devices(cache, block_ids)


def _launch_copy(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor | None,
                 dst_ids: torch.Tensor | None, src_blocks: int, dst_blocks: int) -> None:
    """``dst[..., d_i] = src[..., s_i]`` for the ``n`` blocks of the pair lists; None: the
    side is a buffer, slot ``i`` (``*_blocks`` is then ``n``)."""
    ids = src_ids if src_ids is not None else dst_ids
    n = len(ids)
    outer = math.prod(src.shape[:-4])
    if n == 0 or outer == 0:
        return
    block_numel = math.prod(src.shape[-3:])
    _copy_blocks_kernel[(n, outer)](
        src, dst, ids if src_ids is None else src_ids, ids if dst_ids is None else dst_ids,
        block_numel, src_blocks * block_numel, dst_blocks * block_numel,
        SRC_INDEXED=src_ids is not None, DST_INDEXED=dst_ids is not None,
        BLOCK_E=min(1024, next_power_of_2(block_numel)))
