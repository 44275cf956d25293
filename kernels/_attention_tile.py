"""Triton building blocks shared by the decode and prefill attention kernels.

One step of the online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022,
Algorithm 1) over a tile of ``BLOCK_N`` keys read through a block table. Scores are in log2
units (the caller folds ``log2(e)`` into ``qk_scale``, or into ``cap_log2`` with a softcap) so
the kernels use ``exp2``. With ``SOFTCAP`` (Gemma 2) a score ``s`` becomes ``c * tanh(s *
scale / c)``: the caller passes ``qk_scale = scale / c`` and ``cap_log2 = c * log2(e)``.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_tile_offsets(table_row, pos, end, kv_head, stride_b, stride_s, stride_h,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Element offsets ``[BLOCK_N, BLOCK_D]`` of positions ``pos`` of one KV head in a cache
    ``[num_blocks, block_size, num_kv_heads, head_dim]``, and their mask (``pos < end``)."""
    in_range = pos < end
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    slot = block * stride_b + (pos % BLOCK_SIZE) * stride_s + kv_head * stride_h
    offs_d = tl.arange(0, BLOCK_D)
    offsets = slot[:, None] + offs_d[None, :]
    mask = in_range[:, None] & (offs_d < HEAD_DIM)[None, :]
    return offsets, mask


LOG2E = 1.4426950408889634


def score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """``(qk_scale, cap_log2)`` for ``attend_tile`` from the softmax scale and softcap."""
    if softcap:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0


@triton.jit
def attend_tile(q, K_cache, V_cache, kv_offsets, kv_mask, score_mask, m_i, l_i, acc, qk_scale,
                cap_log2, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                SOFTCAP: tl.constexpr, MASK_SCORES: tl.constexpr = True):
    """Fold one key tile into the running (max ``m_i [M]``, sum ``l_i [M]``, ``acc [M, D]``).

    q: ``[M, BLOCK_D]`` in the cache dtype; score_mask: ``[M, BLOCK_N]``, False where a query
    must not see a key. ``MASK_SCORES`` False: every query sees every key of the tile (the
    caller knows it), so ``score_mask`` is not applied; the same bits as an all-True mask,
    without its compares and selects. Returns the updated ``(m_i, l_i, acc)``, all float32.
    """
    k = tl.load(K_cache + kv_offsets, mask=kv_mask, other=0.0)
    if UPCAST_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    s = s * qk_scale
    if SOFTCAP:  # c * tanh(s / c); tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|)
        e = tl.exp(-2.0 * tl.abs(s))
        s = cap_log2 * tl.where(s >= 0, 1.0, -1.0) * (1.0 - e) / (1.0 + e)
    if MASK_SCORES:
        s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V_cache + kv_offsets, mask=kv_mask, other=0.0)
    if UPCAST_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc
