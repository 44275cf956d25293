"""GGUF weights kept in their block formats (F32 rows too): nothing expanded to float32 at load.

The file is memory-mapped (``gguf_file.GGUFFile``); a tensor already in the requested format is
used in place, as the bytes of its rows (Llama's q/k rows reordered from llama.cpp's rotary
layout to Hugging Face's, a byte copy). Only norms, biases (and a float embedding) become
float32 tensors.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch

from kernels import quant
from kernels.quant import QuantizedWeight

from .config import ModelConfig
from .gguf_file import FLOAT_TYPES, GGUFFile, blocks_of, dequantized
from .loader import GGUFLayout, check_keys

_EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")
# the format of block-quantized tensors the C kernels cannot run as stored (llama.cpp's K-quant
# mixes, Q5_0 / Q5_1; ``auto``'s choice for such files and for mixed ones): 8.5 bits a weight
# keeps a 4-6-bit file's values within Q8_0's rounding, where a 4-bit format would round twice
REQUANTIZED = "q8_0"


@functools.lru_cache(maxsize=8)
def _reader(path: str) -> GGUFFile:
    return GGUFFile(path)


def file_weight_formats(path: str | os.PathLike) -> set[str]:
    """Block formats of the linear layers of a GGUF file (``{"q4_1"}`` for the default
    model); lower-case ggml type names. Raises ``FileNotFoundError`` when ``path`` is missing."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    layout = _layout(str(path))
    return {t.type_name for t in layout.reader.tensors
            if (layout.hf_name(t.name) or "").endswith("_proj.weight")}


@functools.lru_cache(maxsize=8)
def _layout(path: str) -> GGUFLayout:
    return GGUFLayout(_reader(path))


def _quantize(weights: np.ndarray, fmt: str) -> QuantizedWeight:
    """float32 ``[out, in]`` -> ``fmt`` blocks with llama.cpp's reference quantizer (gguf-py)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    data = quantize(np.ascontiguousarray(weights, dtype=np.float32), GGMLQuantizationType[fmt.upper()])
    # NOTE: F32 "quantizes" to float32 values; a QuantizedWeight holds their bytes
    return QuantizedWeight(torch.from_numpy(data.view(np.uint8)), fmt, weights.shape[0],
                           weights.shape[1])


def load_gguf_quantized(path: str | os.PathLike, fmt: str,
                        ) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """Config, float32 tensors (norms, biases; a float embedding) and quantized weights of a
    GGUF file.

    Linear layers come back in ``fmt`` (in place when stored so, else dequantized and
    requantized once); a quantized embedding (and untied LM head) stays in its stored format
    when ``kernels.quant`` supports it, else (a K-quant, Q5_x) becomes ``REQUANTIZED``. Names
    are Hugging Face's.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` (naming the tensor) for an
    unsupported architecture, tensor or format.
    """
    if fmt not in quant.FORMATS:
        raise ValueError(f"quantization: {fmt!r} is not one of {', '.join(quant.FORMATS)}")
    if not Path(path).is_file():
        GGUFFile(path)  # raises FileNotFoundError
    layout = _layout(str(path))
    dense: dict[str, torch.Tensor] = {}
    blocks: dict[str, QuantizedWeight] = {}
    for t in layout.reader.tensors:
        name, stored = layout.hf_name(t.name), t.type_name
        if name is None:
            continue
        if name.endswith("_proj.weight") or (name in _EMBEDDINGS and (
                stored in quant.FORMATS or stored not in FLOAT_TYPES)):
            # an embedding keeps a block format the kernels read; a K-quant one becomes Q8_0
            keep = stored == fmt or (name in _EMBEDDINGS and stored in quant.FORMATS)
            w = (blocks_of(t) if keep
                 else _quantize(dequantized(t), REQUANTIZED if name in _EMBEDDINGS else fmt))
            order = layout.row_order(name)
            if order is not None:
                w = w.rows(torch.from_numpy(order))
            blocks[name] = w
        else:
            dense[name] = torch.from_numpy(np.array(layout.to_hf(name, dequantized(t)),
                                                    dtype=np.float32))
    check_keys(layout.arch, layout.config, {**dense, **blocks}, source=str(path))
    return layout.config, dense, blocks


def quantize_state_dict(config: ModelConfig, state_dict: dict[str, torch.Tensor], fmt: str,
                        ) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """Float weights (Hugging Face names, rotate-half layout) -> linear layers in ``fmt``
    (llama.cpp's reference quantizer); the embedding and LM head stay dense. For tests and
    for checkpoints stored in float."""
    dense, blocks = {}, {}
    for name, w in state_dict.items():
        if name.endswith("_proj.weight"):
            blocks[name] = _quantize(w.float().numpy(), fmt)
        else:
            dense[name] = w
    return config, dense, blocks
