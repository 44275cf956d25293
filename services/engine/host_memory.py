"""The engine's large host buffers (the CPU KV cache, the packed quantized weights): memory the
engine maps itself, zeroed lazily by the kernel and backed by huge pages where the OS allows.

- Lazy zeros: ``torch.zeros`` of the default 1 GiB CPU cache writes every byte at start (about
  0.6-0.8 CPU s of a worker's time-to-ready, and the whole cache resident at once). An anonymous
  private ``mmap`` is zero-filled by the kernel on first touch (POSIX ``mmap``,
  ``MAP_ANONYMOUS``): the start does no work, and a block's pages become resident when a
  request first writes them. The contents are the same, all zeros.
- Huge pages: a decode step streams every weight byte and each sequence's KV, so with 4 KiB pages
  it misses the TLB on every page it reads, and in a virtual machine each miss walks two page
  tables. The map is aligned to 2 MiB and advised ``MADV_HUGEPAGE`` (Linux transparent huge
  pages; honoured in the ``always`` and ``madvise`` modes of
  ``/sys/kernel/mm/transparent_hugepage/enabled``, ignored in ``never``). On a 2-core AMD EPYC
  VM (``python -m scripts.bench_floor`` alternated with the tree before, docs/benchmarks.md) the
  batch-1 TPOT went from 6.3-7.2 to 4.1-4.8 ms at one thread, 4.8-4.9 to 3.8-4.2 at two. The
  cost: a first touch zeroes (and under ``defrag=madvise`` may compact) 2 MiB at once, and
  memory becomes resident 2 MiB at a time.
"""
from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes of an x86-64 / arm64 transparent huge page


def mapped_zeros(nbytes: int) -> torch.Tensor:
    """A contiguous, writable uint8 tensor of ``nbytes`` zeros in an anonymous private map of
    its own, starting on a 2 MiB boundary and advised ``MADV_HUGEPAGE`` where the platform has
    it. The map is unmapped when the tensor (and every view of it) is freed.

    Raises ValueError (``nbytes``) when negative; OSError when the map cannot be made.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes: must be >= 0, got {nbytes}")
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    # NOTE: frombuffer keeps a reference to ``buffer`` for the storage's lifetime
    whole = torch.frombuffer(buffer, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def zeroed_kv_cache(shape: tuple[int, ...], dtype: torch.dtype,
                    device: str | torch.device = "cpu") -> torch.Tensor:
    """A contiguous, writable tensor of zeros of ``shape`` and ``dtype`` on ``device``.

    On CPU it is ``mapped_zeros`` (lazily zeroed, 2 MiB-aligned, huge pages where allowed);
    elsewhere it is ``torch.zeros``.

    Raises ValueError (``shape``) for a negative dimension; OSError when the map cannot be made.
    """
    if any(d < 0 for d in shape):
        raise ValueError(f"shape: dimensions must be >= 0, got {tuple(shape)}")
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return mapped_zeros(nbytes).view(dtype).view(shape)
