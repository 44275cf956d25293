"""Encoders for llama.cpp's K-quant block formats Q4_K and Q6_K, for building test and
benchmark GGUF files: gguf-py decodes every K-quant (``gguf.quants.dequantize``) but encodes
none (``NotImplementedError``), and llama.cpp's ``llama-quantize`` is not a dependency.

Layouts and decoding rules are ggml's (``ggml-common.h`` ``block_q4_K`` / ``block_q6_K``,
``ggml-quants.c`` ``dequantize_row_q4_K`` / ``dequantize_row_q6_K``); the encoders are plain
round-to-nearest, not llama.cpp's error-minimising search (``make_qkx2_quants``), so a file
made here is a little less accurate than llama-quantize's, and decodes by the same rules.

Q4_K, 144 bytes per 256 weights: ``d``, ``dmin`` (float16), ``scales[12]`` (eight 6-bit scales
and eight 6-bit mins, packed), ``qs[128]`` (4-bit); weight = d * sc_j * q - dmin * m_j over
eight sub-blocks of 32. Q6_K, 210 bytes per 256: ``ql[128]`` (low 4 bits), ``qh[64]`` (high 2
bits), ``scales[16]`` (int8), ``d`` (float16); weight = d * sc_j * (q - 32) over sixteen
sub-blocks of 16.
"""
from __future__ import annotations

import numpy as np

QK_K = 256  # weights per K-quant super-block


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[-1] % QK_K:
        raise ValueError(f"K-quants need rows that are a multiple of {QK_K} weights, got {x.shape[-1]}")
    return x.reshape(-1, QK_K)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """``x`` float32 ``[..., n]`` (n a multiple of 256) -> uint8 ``[..., n // 256 * 144]``."""
    blocks = _blocks(x)
    sub = blocks.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)  # weight = d*sc*q - dmin*m with m >= 0
    step = (sub.max(axis=2) - lo) / 15.0  # per sub-block, before 6-bit quantization
    d = (step.max(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(np.divide(step, d[:, None], out=np.zeros_like(step), where=d[:, None] > 0)), 0, 63)
    m = np.clip(np.rint(np.divide(-lo, dmin[:, None], out=np.zeros_like(lo), where=dmin[:, None] > 0)), 0, 63)
    scale = d[:, None] * sc
    q = np.clip(np.rint(np.divide(sub + (dmin[:, None] * m)[:, :, None], scale[:, :, None],
                                  out=np.zeros_like(sub), where=scale[:, :, None] > 0)), 0, 15)
    sc, m, q = sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)
    packed = np.empty((blocks.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    pairs = q.reshape(-1, 4, 2, 32)  # sub-blocks 2k (low nibbles) and 2k+1 (high nibbles)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, qs], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * 144)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """``x`` float32 ``[..., n]`` (n a multiple of 256) -> uint8 ``[..., n // 256 * 210]``."""
    blocks = _blocks(x)
    sub = blocks.reshape(-1, 16, 16)
    step = np.abs(sub).max(axis=2) / 31.0  # q - 32 in [-32, 31]
    d = (step.max(axis=1) / 127.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(np.divide(step, d[:, None], out=np.zeros_like(step), where=d[:, None] > 0)), -128, 127)
    scale = d[:, None] * sc
    q = np.clip(np.rint(np.divide(sub, scale[:, :, None], out=np.zeros_like(sub),
                                  where=scale[:, :, None] != 0)) + 32, 0, 63).astype(np.uint8)
    # each half of 128 weights: four quarters of 32 (y[l], y[l+32], y[l+64], y[l+96])
    quarters = q.reshape(-1, 2, 4, 32)
    low, high = quarters & 0xF, quarters >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)],
                        axis=2).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * 210)
