"""The KV cache's memory: zeros the kernel provides, not zeros the engine writes.

``torch.zeros`` of the default 1 GiB CPU cache writes every byte at start (about 0.6-0.8 CPU s
of a worker's time-to-ready, and the whole cache resident at once). An anonymous private
``mmap`` is zero-filled by the kernel page by page on first touch (POSIX ``mmap``,
``MAP_ANONYMOUS``): the start does no work, and a block's pages become resident when a
request first writes them. The contents are the same, all zeros.
"""
from __future__ import annotations

import math
import mmap

import torch


def zeroed_kv_cache(shape: tuple[int, ...], dtype: torch.dtype,
                    device: str | torch.device = "cpu") -> torch.Tensor:
    """A contiguous, writable tensor of zeros of ``shape`` and ``dtype`` on ``device``.

    On CPU it lives in an anonymous memory map (zeroed lazily by the kernel, page-aligned);
    elsewhere it is ``torch.zeros``. The map is unmapped when the tensor is freed.

    Raises ValueError (``shape``) for a negative dimension; OSError when the map cannot be made.
    """
    if any(d < 0 for d in shape):
        raise ValueError(f"shape: dimensions must be >= 0, got {tuple(shape)}")
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # NOTE: frombuffer keeps a reference to ``buffer`` for the storage's lifetime
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
