"""The K-quant encoders used to build test files (``scripts/kquants.py``) against gguf-py's
decoders, which follow ggml's: a wrong bit anywhere in the packing would decode to noise."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from scripts.kquants import quantize_q4_k, quantize_q6_k


@pytest.mark.parametrize("encode,kind,row_bytes,bound", [
    (quantize_q4_k, GGMLQuantizationType.Q4_K, 144, 0.10),  # 16 levels per sub-block of 32
    (quantize_q6_k, GGMLQuantizationType.Q6_K, 210, 0.025),  # 64 levels per sub-block of 16
])
def test_encoded_blocks_decode_to_the_weights_within_their_rounding(encode, kind, row_bytes, bound):
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 0.05, (8, 512)).astype(np.float32)
    x[3, 256:] = 0.0  # an all-zero super-block
    x[5] = np.abs(x[5])  # no negative weight: min 0
    blocks = encode(x)
    assert blocks.shape == (8, 2 * row_bytes) and blocks.dtype == np.uint8
    y = dequantize(blocks, kind)
    rel_rms = np.sqrt(((y - x) ** 2).mean()) / x.std()
    assert rel_rms < bound
    assert np.array_equal(y[3, 256:], x[3, 256:])


def test_rows_that_are_not_whole_super_blocks_are_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_q4_k(np.zeros((2, 64), dtype=np.float32))
