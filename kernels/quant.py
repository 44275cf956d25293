"""Matrix products on llama.cpp's GGUF weight formats (Q4_0, Q4_1, Q8_0, F32), read in place.

A ``QuantizedWeight`` holds a ``[out_features, in_features]`` matrix as the GGUF file stores
it: per row, ``in_features / 32`` blocks of 18 (Q4_0), 20 (Q4_1), 34 (Q8_0) or 128 (F32: 32
plain floats, not quantized) bytes; nothing is expanded to float32. ``quant_matmul`` runs the C
kernel ``csrc/quant_matmul.c`` (OpenMP; AVX512-VNNI, AVX2 or scalar, picked by the build for
the CPU it runs on). For the quantized formats, activations are quantized to int8 per
32-element block and multiplied with integer dot products, llama.cpp's method (ggml-cpu
``quants.c``, ``ggml_vec_dot_q4_1_q8_1`` and friends); the error against
dequantize-then-matmul is the activation rounding: at most ``dx / 2`` per element,
``dx = max|x_block| / 127`` (see ``activation_error_bound``). F32 rows are multiplied in
float32 (ggml's ``ggml_vec_dot_f32``): only the float32 sums' rounding.

The kernel is built on first use like ``kernels.cpu_attention`` (same compiler, flags and
cache directory, keyed by source, flags and CPU). Without a compiler the functions fall back to
dequantize-then-``torch.mm`` (correct, slow, logged once). This module imports nothing from
``services``.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from kernels.cpu_attention import build_shared_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "quant_matmul.c"
BLOCK = 32  # elements per block in every supported format
# format name -> (kernel code, bytes per block of 32 elements); "f32" is not quantized
FORMATS = {"q4_0": (0, 18), "q4_1": (1, 20), "q8_0": (2, 34), "f32": (3, 128)}
# what a QuantizedWeight may hold: the file formats, and Q4_1 and Q8_0 in 16-row tiles
# (``tiled16``; same bytes per block as the file format they rearrange)
RESIDENT = {**FORMATS, "q4_1x16": (4, 20), "q8_0x16": (5, 34)}
TILED = {"q4_1": "q4_1x16", "q8_0": "q8_0x16"}  # file format -> its 16-row tiles
UNTILED = {v: k for k, v in TILED.items()}
_HEADER = {"q4_1": 4, "q8_0": 2}  # bytes of fp16 fields (d, Q4_1's m) before a block's quants
TILE = 16  # rows of a tile
QUANTIZED = tuple(f for f in FORMATS if f != "f32")  # activations quantized to int8 for these
_ERRORS = {1: "unknown block format", 2: "bad shape (in_features must be a positive multiple "
           "of 32; row ids inside the matrix)", 3: "out of memory for the kernel's scratch"}
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# the kernel's dot-product paths by its codes (ISA_* in the C file), worst first
ISAS = ("scalar", "avx2", "avx512_vnni")


@dataclass(frozen=True)
class QuantizedWeight:
    """A ``[out_features, in_features]`` weight in a GGUF block format.

    ``data``: uint8 ``[out_features, in_features // 32 * block_bytes]``, each row the file's
    blocks in order (may be a view of a memory-mapped file). Raises ``ValueError`` naming the
    field when the format is unknown, ``in_features`` is not a positive multiple of 32, or
    ``data``'s shape does not match.
    """

    data: torch.Tensor
    fmt: str
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        if self.fmt not in RESIDENT:
            raise ValueError(f"fmt: unsupported block format {self.fmt!r}; "
                             f"supported: {', '.join(RESIDENT)}")
        if self.fmt in UNTILED and self.out_features % TILE:
            raise ValueError(f"out_features: {self.out_features} is not a multiple of {TILE} "
                             f"({self.fmt} stores tiles of 16 rows)")
        if self.in_features <= 0 or self.in_features % BLOCK:
            raise ValueError(f"in_features: {self.in_features} is not a positive multiple of "
                             f"{BLOCK} (the {self.fmt} block size)")
        shape = (self.out_features, self.in_features // BLOCK * RESIDENT[self.fmt][1])
        if (self.data.dtype != torch.uint8 or tuple(self.data.shape) != shape
                or not self.data.is_contiguous()):
            raise ValueError(f"data: expected contiguous uint8 {list(shape)} for {self.fmt} "
                             f"[{self.out_features}, {self.in_features}], got "
                             f"{self.data.dtype} {list(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index: torch.Tensor | np.ndarray) -> QuantizedWeight:
        """The rows ``index`` (a permutation or selection), copied; still quantized (tiles come
        back in their file format: q4_1x16 as q4_1)."""
        flat = untiled16(self) if self.fmt in UNTILED else self
        data = flat.data[torch.as_tensor(index, dtype=torch.int64)].contiguous()
        return QuantizedWeight(data, flat.fmt, data.shape[0], self.in_features)


def tiled16(weight: QuantizedWeight) -> QuantizedWeight:
    """A Q4_1 or Q8_0 weight (``out_features`` a multiple of 16) repacked in tiles of 16 rows:
    ``q4_1x16``: per tile and block, the rows' nibble bytes ``4k..4k+3`` side by side for
    k = 0..3 (lanes = rows), then their 16 fp16 ``d``, then their 16 fp16 ``m`` (320 bytes);
    ``q8_0x16``: the rows' int8 bytes ``4g..4g+3`` side by side for g = 0..7, then their 16
    fp16 ``d`` (544 bytes). The same bytes, so the same size, and the same values: every kernel
    path gives the same bits as on the file's rows; the kernels read a tile without gathers or
    transposes (``csrc/quant_matmul.c``, ggml-cpu's repacked-weights idea). Raises ValueError
    unless ``weight`` is Q4_1 or Q8_0 with such rows."""
    if weight.fmt not in TILED or weight.out_features % TILE:
        raise ValueError(f"weight: q4_1 or q8_0 with a multiple of {TILE} rows is required, got "
                         f"{weight.fmt} with {weight.out_features}")
    t, nb = weight.out_features // TILE, weight.in_features // BLOCK
    size, head = FORMATS[weight.fmt][1], _HEADER[weight.fmt]
    raw = weight.data.view(t, TILE, nb, size)
    # (tile, block, dword or fp16 field, row, byte): the 16 rows side by side
    qs = raw[..., head:].reshape(t, TILE, nb, -1, 4).permute(0, 2, 3, 1, 4).reshape(t, nb, -1)
    fields = raw[..., :head].reshape(t, TILE, nb, -1, 2).permute(0, 2, 3, 1, 4).reshape(t, nb, -1)
    data = torch.cat([qs, fields], -1).reshape(weight.data.shape).contiguous()
    return QuantizedWeight(data, TILED[weight.fmt], weight.out_features, weight.in_features)


def untiled16(weight: QuantizedWeight) -> QuantizedWeight:
    """Inverse of ``tiled16``: the rows as the file stores them."""
    fmt = UNTILED[weight.fmt]
    t, nb = weight.out_features // TILE, weight.in_features // BLOCK
    size, head = FORMATS[fmt][1], _HEADER[fmt]
    raw = weight.data.view(t, nb, TILE * size)
    split = TILE * (size - head)
    qs = raw[..., :split].reshape(t, nb, -1, TILE, 4).permute(0, 3, 1, 2, 4).reshape(t, TILE, nb, -1)
    fields = raw[..., split:].reshape(t, nb, -1, TILE, 2).permute(0, 3, 1, 2, 4).reshape(t, TILE, nb, -1)
    data = torch.cat([fields, qs], -1).reshape(weight.data.shape).contiguous()
    return QuantizedWeight(data, fmt, weight.out_features, weight.in_features)


def decode_layout(parts: Sequence[QuantizedWeight]) -> list[QuantizedWeight]:
    """The parts of one projection as the kernels read them fastest: Q4_1 or Q8_0 parts that
    all have a multiple of 16 rows repacked ``tiled16`` where the AVX-512 VNNI path runs
    (others gain nothing from it); anything else as given."""
    if (isa() != "avx512_vnni" or len({p.fmt for p in parts}) != 1 or parts[0].fmt not in TILED
            or any(p.out_features % TILE for p in parts)):
        return list(parts)
    return [tiled16(p) for p in parts]


def build(compiler: str | None = None) -> Path:
    """Compile ``csrc/quant_matmul.c`` (unless cached) and return the shared library's path.

    Raises ``RuntimeError`` with the compiler's output when no compiler exists or the build fails.
    """
    return build_shared_library(SOURCE, compiler)


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        log.warning("quantized matmul kernel unavailable, dequantizing to float32 instead: %s", e)
        return None
    lib.tandem_quant_matmul_f32.argtypes = ([_PTR] * 3 + [_INT, _PTR] + [_I64] * 3
                                            + [_INT] * 3)
    lib.tandem_quant_dequantize_rows.argtypes = [_PTR] * 3 + [_I64] * 3 + [_INT]
    return lib


def available() -> bool:
    """Whether the C kernel is built and loaded (building it if needed)."""
    return _library() is not None


def isa() -> str:
    """The kernel's best dot-product path on this build and CPU: ``avx512_vnni``, ``avx2``,
    ``scalar``, or ``none`` (no kernel: the float32 fallback runs)."""
    lib = _library()
    return ISAS[lib.tandem_quant_max_isa()] if lib is not None else "none"


def isas() -> list[str]:
    """Every path this build can run (``quant_matmul(..., isa=...)``), worst first:
    ``scalar``, ``avx2`` (AVX2 and FMA or better), ``avx512_vnni``. Every path sums each
    output in the same order, so they give the same bits (``csrc/quant_matmul.c``'s header)."""
    lib = _library()
    return list(ISAS[:lib.tandem_quant_max_isa() + 1]) if lib is not None else []


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise ValueError(f"{what}: {_ERRORS.get(rc, f'error {rc}')}")


def dequantize_rows(weight: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int ``[R]``) of ``weight`` as float32 ``[R, in_features]``, exactly as
    ``gguf.quants.dequantize`` computes them. Raises ``ValueError`` for an id outside the rows."""
    ids = ids.to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.out_features):
        raise ValueError(f"ids: row ids must lie in [0, {weight.out_features})")
    out = torch.empty(ids.numel(), weight.in_features, dtype=torch.float32)
    lib = _library()
    if lib is None:
        flat = untiled16(weight) if weight.fmt in UNTILED else weight
        return torch.from_numpy(_numpy_dequantize(flat.data[ids].numpy(), flat.fmt))
    data = weight.data.contiguous()
    _check(lib.tandem_quant_dequantize_rows(data.data_ptr(), ids.data_ptr(), out.data_ptr(),
                                            ids.numel(), weight.out_features,
                                            weight.in_features, RESIDENT[weight.fmt][0]),
           "dequantize_rows")
    return out


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The whole weight as float32 ``[out_features, in_features]`` (tests, fallbacks)."""
    return dequantize_rows(weight, torch.arange(weight.out_features))


def _numpy_dequantize(data: np.ndarray, fmt: str) -> np.ndarray:
    """Fallback without the C kernel: gguf-py's dequantizer on ``[rows, row_bytes]`` bytes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(data, GGMLQuantizationType[fmt.upper()]).astype(np.float32)


_default_isa: str | None = None  # set_default_isa: the path quant_matmul runs when not told


def set_default_isa(name: str | None) -> None:
    """Make ``quant_matmul`` run path ``name`` (one of ``isas()``; ``None``: the best) when its
    ``isa`` argument is not given: benchmarks compare paths inside the engine with it. Raises
    ``ValueError`` naming ``isa`` for a path this build lacks."""
    global _default_isa
    if name is not None and name not in isas():
        raise ValueError(f"isa: {name!r} is not a path of this kernel build; have {isas()}")
    _default_isa = name


def _check_parts(parts: Sequence[QuantizedWeight]) -> tuple[str, int]:
    fmt, k = parts[0].fmt, parts[0].in_features
    if any(p.fmt != fmt or p.in_features != k for p in parts) or not 1 <= len(parts) <= 8:
        raise ValueError("weight: 1 to 8 parts of one format and in_features are required")
    return fmt, k


def quant_matmul(x: torch.Tensor, weight: QuantizedWeight | Sequence[QuantizedWeight],
                 out: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
    """``x @ W^T`` with ``W`` in its block format: x ``[..., in_features]`` -> float32
    ``[..., out_features]`` (into ``out`` when given: float32, contiguous, ``[M, out_features]``).
    ``weight`` may be a list of parts (same format and ``in_features``) stacked along
    ``out_features`` without copying them together: fused q/k/v or gate/up in one call.
    Non-float32 activations are computed in float32 and the result cast back to their dtype.
    ``isa`` caps the kernel's dot-product path (one of ``isas()``; default the best): tests run
    the AVX2 and scalar paths on AVX-512 machines with it.

    Raises ``ValueError`` when ``x``'s last dimension is not ``in_features``, the parts differ
    in format or ``in_features``, there are more than 8 parts, or ``isa`` is not in ``isas()``.
    """
    parts = [weight] if isinstance(weight, QuantizedWeight) else list(weight)
    fmt, k = _check_parts(parts)
    if x.shape[-1] != k:
        raise ValueError(f"x: last dimension {x.shape[-1]} != in_features {k}")
    lead, dtype = x.shape[:-1], x.dtype
    n = sum(p.out_features for p in parts)
    # NOTE: a decode step makes ~150 of these calls: skip torch ops that would be no-ops
    x2 = x if x.dim() == 2 and dtype == torch.float32 and x.is_contiguous() else (
        x.reshape(-1, k).to(torch.float32).contiguous())
    lib = _library()
    level = isa_level(isa)
    if lib is None:
        y = x2 @ torch.cat([dequantize(p) for p in parts]).T
        return (y if out is None else out.copy_(y)).reshape(*lead, n).to(dtype)
    if out is None:
        out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    ptrs, rows = _part_arrays(tuple((p.data.data_ptr(), p.out_features) for p in parts))
    _check(lib.tandem_quant_matmul_f32(x2.data_ptr(), ptrs, rows, len(parts), out.data_ptr(),
                                       x2.shape[0], k, n, RESIDENT[fmt][0], torch.get_num_threads(),
                                       level),
           "quant_matmul")
    return out if x2 is x else out.reshape(*lead, n).to(dtype)


def isa_level(isa: str | None = None) -> int:
    """The kernel's ``isa`` argument (an index into ``ISAS``) for path ``isa``, or when not
    given for the path ``quant_matmul`` runs when not told (``set_default_isa``; checked there).
    Raises ``ValueError`` naming ``isa`` for a path this build lacks."""
    if isa is not None and isa not in isas():
        raise ValueError(f"isa: {isa!r} is not a path of this kernel build; have {isas()}")
    isa = isa or _default_isa
    return ISAS.index(isa) if isa is not None else len(ISAS) - 1


@functools.lru_cache(maxsize=4096)
def _part_arrays(parts: tuple[tuple[int, int], ...]) -> tuple[ctypes.Array, ctypes.Array]:
    """The kernel's ``parts`` and ``part_rows`` arrays for ``(data address, rows)`` pairs
    (plain numbers: the cache keeps no tensor alive)."""
    return (_PTR * len(parts))(*[a for a, _ in parts]), (_I64 * len(parts))(*[r for _, r in parts])


def block_scales(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block ``(d, c)`` float32 ``[out_features, in_features // 32]`` with
    ``w = d * u + c`` for the kernel's unsigned ``u`` (Q4: 0..15, Q8_0: 0..255), read from the
    blocks' fp16 fields. Raises ``ValueError`` naming ``fmt`` for F32 (no block scales)."""
    if weight.fmt in UNTILED:
        return block_scales(untiled16(weight))
    if weight.fmt not in QUANTIZED:
        raise ValueError(f"fmt: {weight.fmt} weights have no block scales")
    nb, nbytes = weight.in_features // BLOCK, RESIDENT[weight.fmt][1]
    raw = weight.data.reshape(weight.out_features, nb, nbytes)
    d = raw[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    if weight.fmt == "q4_1":
        c = raw[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    else:
        c = d * (-8.0 if weight.fmt == "q4_0" else -128.0)
    return d, c


def activation_error_bound(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """Largest possible ``|quant_matmul(x, W) - x @ dequantize(W)^T|``, float32 ``[M, N]``.

    Two sources, both derived from the method, neither tuned: (1) each activation is rounded to
    the nearest multiple of its block's ``dx = max|x_b| / 127``, so the product errs by at most
    ``sum_k dx_k / 2 * |W[n, k]|``; (2) float32 arithmetic on the per-block terms
    ``d_w dx sum(u q)`` and ``c_w dx sum(q)``: at most ``gamma * sum_b |terms|`` with
    ``gamma = (K / 32 + 4) * 2 * 2^-24`` (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., section 3.1: a sum of n products errs by at most gamma_n sum |terms|).
    F32 weights have only (2): ``gamma_K * |x| @ |W|^T`` (the panel kernel sums k in order;
    the row kernel's 16 lane sums and tree are shallower).
    """
    x = x.reshape(-1, x.shape[-1]).float()
    m, k = x.shape
    if weight.fmt == "f32":
        gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
        return gamma * (x.abs().double() @ dequantize(weight).abs().double().T).float()
    nb = k // BLOCK
    dx = x.abs().reshape(m, nb, BLOCK).amax(-1) / 127.0  # [M, nb]
    w = dequantize(weight)
    rounding = (dx / 2).repeat_interleave(BLOCK, dim=1) @ w.abs().T
    d, c = block_scales(weight)
    umax = 255.0 if UNTILED.get(weight.fmt, weight.fmt) == "q8_0" else 15.0
    x_abs = (x.abs() + dx.repeat_interleave(BLOCK, dim=1) / 2).reshape(m, nb, BLOCK).sum(-1)
    terms = x_abs @ (d.abs() * umax).T + x_abs @ c.abs().T  # [M, N]
    gamma = (nb + 4) * 2 * 2.0**-24
    return rounding + gamma * terms
