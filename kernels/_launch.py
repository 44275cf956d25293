"""Launch helpers shared by the Triton wrappers (host side only; imports no triton)."""
from __future__ import annotations

import torch


def dot_options(dtype: torch.dtype, device: torch.device) -> dict[str, object]:
    """Constexpr kernel arguments for ``tl.dot`` on inputs of ``dtype``.

    ``PRECISION``: "ieee" for float32 (full fp32 products; Triton would otherwise use TF32 on
    NVIDIA GPUs), "tf32" (ignored) for 16-bit inputs, which run on tensor cores.
    ``UPCAST_DOT``: NOTE: the Triton interpreter (CPU tensors, ``TRITON_INTERPRET=1``) computes
    ``tl.dot`` of bfloat16 operands wrongly (triton 3.9), so there both operands go to float32
    first; every other step (loads, conversions, stores) is the GPU's code path.
    """
    return {
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "UPCAST_DOT": device.type == "cpu" and dtype == torch.bfloat16,
    }


def launch_options(num_warps: int | None, num_stages: int | None) -> dict[str, int]:
    """Triton launch keywords for the options given (None: Triton's default)."""
    return {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages))
            if v is not None}


def check_devices(*tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every tensor is on the first one's device."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"kernel arguments on different devices: {device} and {t.device} "
                             "(attention metadata must live on the model's device)")


def check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Shape, dtype, stride and device checks shared by the attention wrappers."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have equal shapes and strides")
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads {num_heads}x{head_dim} do not fit cache heads "
                         f"{num_kv_heads}x{k_cache.shape[3]}")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, cache {k_cache.dtype}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("the head_dim axis of q and of the caches must be contiguous")
    if len(block_tables) != len(seq_lens):
        raise ValueError(f"{len(block_tables)} block tables for {len(seq_lens)} sequences")
    check_devices(q, k_cache, v_cache, block_tables, seq_lens)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
