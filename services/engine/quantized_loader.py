"""GGUF weights kept in their block formats (F32 rows too): nothing expanded to float32 at load.

The file is memory-mapped (``gguf_file.GGUFFile``); a tensor already in the requested format is
used in place, as the bytes of its rows (q/k rows reordered from llama.cpp's rotary layout to
Hugging Face's, a byte copy). Only norms (and a float embedding) become float32 tensors.
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
from .gguf_file import GGUFFile, blocks_of, dequantized
from .loader import _check_keys, _gguf_config, _hf_name

_EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")


@functools.lru_cache(maxsize=8)
def _reader(path: str) -> GGUFFile:
    return GGUFFile(path)


def file_weight_formats(path: str | os.PathLike) -> set[str]:
    """Block formats of the linear layers of a GGUF file (``{"q4_1"}`` for the default
    model); lower-case ggml type names. Raises ``FileNotFoundError`` when ``path`` is missing."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    return {t.type_name for t in _reader(str(path)).tensors
            if _hf_name(t.name).endswith("_proj.weight")}


def rotary_row_order(out_features: int, num_heads: int) -> torch.Tensor:
    """Row permutation taking llama.cpp's interleaved rotary rows to Hugging Face's
    rotate-half order: ``hf_rows = gguf_rows[order]`` (the row form of
    ``loader._unpermute_rotary``). int64 ``[out_features]``."""
    head_dim = out_features // num_heads
    rows = torch.arange(out_features).reshape(num_heads, head_dim // 2, 2)
    return rows.transpose(1, 2).reshape(-1)


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
    """Config, float32 tensors (norms; a float embedding) and quantized weights of a Llama GGUF.

    Linear layers come back in ``fmt`` (in place when stored so, else dequantized and
    requantized once); a quantized embedding (and untied LM head) stays in its stored format
    when ``kernels.quant`` supports it. Names are Hugging Face's.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` (naming the tensor) for an
    unsupported architecture, tensor or format.
    """
    if fmt not in quant.FORMATS:
        raise ValueError(f"quantization: {fmt!r} is not one of {', '.join(quant.FORMATS)}")
    reader = _reader(str(path)) if Path(path).is_file() else GGUFFile(path)
    config = _gguf_config(reader, {t.name for t in reader.tensors})
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    dense: dict[str, torch.Tensor] = {}
    blocks: dict[str, QuantizedWeight] = {}
    for t in reader.tensors:
        name, stored = _hf_name(t.name), t.type_name
        if name.endswith("_proj.weight") or (name in _EMBEDDINGS and stored in quant.FORMATS):
            keep = stored == fmt or name in _EMBEDDINGS
            w = (blocks_of(t) if keep
                 else _quantize(dequantized(t), fmt))
            kind = t.name.split(".")[-2]
            if kind in heads:
                w = w.rows(rotary_row_order(w.out_features, heads[kind]))
            blocks[name] = w
        else:
            dense[name] = torch.from_numpy(np.array(dequantized(t), dtype=np.float32))
    _check_keys(config, {**dense, **blocks}, source=str(path))
    return config, dense, blocks


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
