"""``quant_matmul`` with its arguments prepared once: the decode step's hot path.

``PreparedMatmul`` holds one weight's (or fused weights') ctypes arrays and calls the C kernel
of ``kernels.quant`` directly: one ctypes call per use, no per-call checks or allocations.
``kernels.decode_ops`` reads its addresses to call the kernel from C.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from kernels.quant import (RESIDENT, QuantizedWeight, _check, _check_parts, _library,
                           _part_arrays, isa_level)


class PreparedMatmul:
    """``quant_matmul`` for fixed weight parts with the kernel's arguments built once: the decode
    step's hot path (one ctypes call per use, no per-call checks or allocations).

    ``parts``: as ``quant_matmul``'s ``weight``. Raises ``ValueError`` as ``quant_matmul`` does
    for bad parts, ``RuntimeError`` when the C kernel is not available.
    """

    def __init__(self, parts: Sequence[QuantizedWeight]) -> None:
        if (lib := _library()) is None:
            raise RuntimeError("the quantized matmul kernel is not built (no C compiler?)")
        fmt, k = _check_parts(parts)
        self.parts = tuple(parts)  # keeps the blocks alive while the addresses are used
        self.in_features, self.out_features = k, sum(p.out_features for p in parts)
        self._fn, self.fmt_code = lib.tandem_quant_matmul_f32, RESIDENT[fmt][0]
        self._ptrs, self._rows = _part_arrays(tuple((p.data.data_ptr(), p.out_features)
                                                    for p in parts))

    @property
    def kernel_address(self) -> int:
        """Address of the C function ``tandem_quant_matmul_f32`` (for a C caller)."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value

    def addresses(self) -> tuple[int, int, int]:
        """``(parts array, part_rows array, number of parts)`` as the kernel takes them, for a
        C caller (``kernels.decode_ops``); the addresses stay valid while this object lives."""
        return ctypes.addressof(self._ptrs), ctypes.addressof(self._rows), len(self.parts)

    def __call__(self, x: torch.Tensor, out: torch.Tensor, num_threads: int) -> torch.Tensor:
        """``out = x @ W^T``: x float32 contiguous ``[M, in_features]``, out float32 contiguous
        ``[M, out_features]`` (not checked: the caller owns both). Returns ``out``."""
        _check(self._fn(x.data_ptr(), self._ptrs, self._rows, len(self.parts), out.data_ptr(),
                        x.shape[0], self.in_features, self.out_features, self.fmt_code,
                        num_threads, isa_level()), "quant_matmul")
        return out
