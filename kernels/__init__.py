"""Kernels of the engine (Triton for GPUs, C for CPU decode), each beside the torch reference it is tested against.

- ``kernels.reference``: plain torch (the CPU path, and the oracle); needs nothing but torch.
- ``kernels.cpu_attention``: paged decode attention for CPUs in C (OpenMP), built on first use.
- ``kernels.decode_attention``: paged decode attention, split-K (flash-decoding), GQA-grouped.
- ``kernels.prefill_attention``: prefill / chunked prefill over the paged cache, packed varlen.
- ``kernels.paged_attention``: one ragged batch (decodes first, then prefills): both of the above.
- ``kernels.cache_ops``: cache write by slot mapping; block gather / scatter.
- ``kernels.bench``: GPU benchmarks of the attention kernels (``python -m kernels.bench``).

The Triton modules import ``triton`` at import time, so import them only when it is installed
(``triton_available()``) and only for CUDA tensors, or for CPU tensors with
``TRITON_INTERPRET=1`` set before triton is first imported (the tests do this). This package
imports nothing from ``services``.
"""
from __future__ import annotations

import functools
import importlib.util


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None
