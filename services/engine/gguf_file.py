"""A minimal GGUF reader for the serving path: metadata scalars and memory-mapped tensors.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array (the default
model's 49,152 vocabulary strings and 48,900 merges), which took seconds of a worker's start.
This reader walks the same format (GGUF v2/v3, ggml's ``docs/gguf.md``) with ``struct``, skips
array contents it is not asked for, and maps the file once with numpy so tensor bytes are
never copied. Tensor data start at the header's end rounded up to ``general.alignment``
(default 32).
"""
from __future__ import annotations

import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
# GGUF metadata value types -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
# ggml type id -> (name, elements per block, bytes per block) for the types this project reads:
# ggml's ``ggml_type`` ids and ``type_traits`` sizes. Q4_0, Q4_1 and Q8_0 the C kernels run as
# stored; Q5_0, Q5_1 and the K-quants (llama.cpp's Q4_K_M and friends mix Q4_K / Q5_K with Q6_K)
# are decoded by gguf-py at load (``quantized`` serves them requantized)
GGML_TYPES = {0: ("f32", 1, 4), 1: ("f16", 1, 2), 2: ("q4_0", 32, 18), 3: ("q4_1", 32, 20),
              6: ("q5_0", 32, 22), 7: ("q5_1", 32, 24), 8: ("q8_0", 32, 34),
              10: ("q2_k", 256, 84), 11: ("q3_k", 256, 110), 12: ("q4_k", 256, 144),
              13: ("q5_k", 256, 176), 14: ("q6_k", 256, 210), 30: ("bf16", 1, 2)}
FLOAT_TYPES = frozenset({"f32", "f16", "bf16"})  # the unquantized ones


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # lower-case ggml type, e.g. "q4_1"
    shape: tuple[int, ...]  # numpy / torch order: [out_features, in_features]
    data: np.ndarray  # uint8 [rows, row bytes] view of the memory map (read-only)


class GGUFFile:
    """Metadata (``fields``: key -> scalar, string, or list for arrays of scalars; arrays of
    strings only as their length unless listed in ``read_string_arrays``) and tensors (none
    with ``read_tensors=False``).

    Raises ``ValueError`` for a file that is not GGUF v2/v3 or has a tensor of a type outside
    ``GGML_TYPES`` (named in the message), ``FileNotFoundError`` when ``path`` is missing.
    """

    def __init__(self, path: str | os.PathLike, read_string_arrays: tuple[str, ...] = (),
                 read_tensors: bool = True) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)
        self._pos = 0
        if bytes(self._buf[:4]) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (magic {bytes(self._buf[:4])!r})")
        self._pos = 4
        version, num_tensors, num_kv = self._read("I"), self._read("Q"), self._read("Q")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        self.fields: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string()
            self.fields[key] = self._value(self._read("I"), key in read_string_arrays)
        if not read_tensors:  # metadata only (a tokenizer): any tensor type is fine
            self.tensors = []
            return
        infos = [self._tensor_info() for _ in range(num_tensors)]
        align = int(self.fields.get("general.alignment", 32))
        start = (self._pos + align - 1) // align * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _read(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        (value,) = struct.unpack_from("<" + fmt, self._buf, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._read("Q")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8")
        self._pos += n
        return s

    def _value(self, kind: int, read_strings: bool) -> Any:
        if kind in _SCALARS:
            return self._read(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF metadata type {kind}")
        item, n = self._read("I"), self._read("Q")
        if item in _SCALARS:
            fmt = "<" + str(n) + _SCALARS[item]
            values = list(struct.unpack_from(fmt, self._buf, self._pos))
            self._pos += struct.calcsize(fmt)
            return values
        if item == _STRING and read_strings:
            return [self._string() for _ in range(n)]
        if item == _STRING:  # NOTE: skipped, only the count is kept (vocabularies are large)
            for _ in range(n):
                self._pos += 8 + struct.unpack_from("<Q", self._buf, self._pos)[0]
            return n
        return [self._value(item, read_strings) for _ in range(n)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._read("Q") for _ in range(self._read("I")))
        return name, dims, self._read("I"), self._read("Q")

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: int,
                offset: int) -> GGUFTensor:
        if kind not in GGML_TYPES:
            raise ValueError(f"{self.path}: tensor {name} has ggml type {kind}, not one of "
                             f"{sorted(v[0] for v in GGML_TYPES.values())}")
        type_name, per_block, block_bytes = GGML_TYPES[kind]
        shape = tuple(int(d) for d in reversed(dims))
        row_bytes = shape[-1] // per_block * block_bytes
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        data = self._map[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
        return GGUFTensor(name, type_name, shape, np.asarray(data))

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def blocks_of(tensor: GGUFTensor):
    """A quantized tensor's bytes in place (no copy) as a ``kernels.quant.QuantizedWeight``
    ``[rows, in_features]``; raises ``ValueError`` for a format ``kernels.quant`` lacks."""
    import torch

    from kernels.quant import QuantizedWeight

    with warnings.catch_warnings():
        # NOTE: the memory map is read-only; torch warns that it cannot be written. It never is.
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(tensor.data)
    return QuantizedWeight(data, tensor.type_name, data.shape[0], tensor.shape[-1])


def dequantized(tensor: GGUFTensor) -> np.ndarray:
    """A tensor of the file as float32 in its numpy shape: gguf-py's dequantizers' values
    (computed by ``kernels.quant`` when its C kernel is available)."""
    if tensor.type_name in ("f32", "f16"):
        flat = tensor.data.view(np.float32 if tensor.type_name == "f32" else np.float16)
        return flat.reshape(tensor.shape).astype(np.float32, copy=False)
    from kernels import quant

    if tensor.type_name in quant.FORMATS and quant.available():
        # NOTE: the C kernel's rows equal gguf-py's bit for bit (tests/kernels), ~10x faster
        return quant.dequantize(blocks_of(tensor)).numpy().reshape(tensor.shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType[tensor.type_name.upper()]
    return dequantize(tensor.data, kind).reshape(tensor.shape).astype(np.float32, copy=False)
