"""Whole-block gather / scatter of a paged KV cache, dispatched on the cache's device: the
Triton kernels (``kernels.cache_ops``) for CUDA tensors, the torch reference elsewhere. Used to
stage KV blocks through host memory for transfer, and to copy them between two caches (the
KV handoff by CUDA IPC: one kernel on one device, gather / copy / scatter between GPUs)."""
from __future__ import annotations

import torch

from kernels import reference, triton_available


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``block_ids`` (``[n]`` int64, on ``cache``'s device) of ``cache``
    (``[..., num_blocks, block_size, num_kv_heads, head_dim]``) as a new contiguous
    ``[..., n, block_size, num_kv_heads, head_dim]`` tensor. Raises RuntimeError for a CUDA
    cache without triton."""
    if cache.is_cuda:
        with torch.cuda.device(cache.device):  # Triton launches on the current device
            return _cache_ops().gather_blocks(cache, block_ids)
    return reference.gather_blocks(cache, block_ids)


def scatter_blocks(buffer: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Inverse of ``gather_blocks``, in place (``buffer`` on ``cache``'s device, ids distinct)."""
    if cache.is_cuda:
        with torch.cuda.device(cache.device):
            _cache_ops().scatter_blocks(buffer, cache, block_ids)
    else:
        reference.scatter_blocks(buffer, cache, block_ids)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor,
                dst_ids: torch.Tensor) -> None:
    """``dst[..., dst_ids[i], ...] = src[..., src_ids[i], ...]`` between two paged caches
    (``[..., num_blocks, block_size, num_kv_heads, head_dim]``, equal but for ``num_blocks``),
    in place. Ids: ``[n]`` int64, ``src_ids`` on ``src``'s device, ``dst_ids`` on ``dst``'s.
    One Triton pass when both caches are on one CUDA device; otherwise a gather, a copy
    between the devices and a scatter. Raises RuntimeError for a CUDA cache without triton."""
    if src.is_cuda and src.device == dst.device:
        with torch.cuda.device(src.device):
            _cache_ops().copy_blocks(src, dst, src_ids, dst_ids)
    else:
        scatter_blocks(gather_blocks(src, src_ids).to(dst.device), dst, dst_ids)


def _cache_ops():
    if not triton_available():
        raise RuntimeError("a CUDA KV cache needs triton for block copies: pip install 'tandem[gpu]'")
    import kernels.cache_ops

    return kernels.cache_ops
