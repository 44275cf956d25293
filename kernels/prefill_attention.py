"""Prefill and chunked-prefill attention in Triton over the paged KV cache, varlen-packed.

Queries of many sequences are packed without padding (``query_start_loc`` offsets). Each
sequence's queries are the last ``q_len`` of its ``seq_len`` positions, their K/V already in
the cache; they attend causally to everything before them: the cached prefix (prefix-cache
hits, earlier chunks) and the chunk itself, all read through the block table.

Algorithm: FlashAttention-2's forward pass (Dao 2023, Algorithm 1) with the K/V tiles gathered
through the block table, as in vLLM's prefix-prefill and unified-attention Triton kernels. One
program per (query tile, KV head): the tile packs ``BLOCK_Q`` tokens x all query heads of the KV
head into the ``tl.dot`` rows, so each K/V tile is loaded once for the whole GQA group. Query
tiles are numbered densely over the batch (each sequence gets ``q_len // BLOCK_Q + 1`` or fewer
slots) and a program finds its sequence by binary search over ``query_start_loc``, so ragged
batches launch no grid of ``num_seqs x max_query_len`` mostly-empty programs. Key tiles that
every query of a tile sees whole (the cached prefix and the chunk's earlier tiles) skip the
causal mask, as the off-diagonal blocks of FlashAttention-2's causal forward do; only the
tiles on the diagonal are masked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_tile import attend_tile, kv_tile_offsets, score_scales
from ._launch import (check_attention_args, check_devices, dot_options, launch_options,
                      next_power_of_2)


@triton.jit
def _find_sequence(Query_start_loc, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence ``s`` whose first tile slot ``query_start_loc[s] // BLOCK_Q + s`` is
    at or before ``tile_idx`` (binary search)."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_slot = tl.load(Query_start_loc + mid) // BLOCK_Q + mid
        if first_slot <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_keys(q, K_cache, V_cache, table_row, kv_head, stride_b, stride_s, stride_h, lo, hi,
                 kv_end, q_pos, window, m_i, l_i, acc, qk_scale, cap_log2,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 SOFTCAP: tl.constexpr, MASKED: tl.constexpr, SLIDING: tl.constexpr):
    """Fold the key tiles ``lo, lo + BLOCK_N, .. < hi`` of one sequence's KV head (its
    block-table row ``table_row``; the caches' block, slot and head strides) into the running
    (m_i, l_i, acc); ``MASKED``: apply the causal (and window) mask of ``q_pos`` and
    ``kv_end``, else every query sees every key of these tiles."""
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        kv_offsets, kv_mask = kv_tile_offsets(table_row, pos, kv_end, kv_head, stride_b,
                                              stride_s, stride_h, BLOCK_SIZE, HEAD_DIM, BLOCK_D)
        visible = None
        if MASKED:
            visible = (pos[None, :] <= q_pos[:, None]) & (pos < kv_end)[None, :]
            if SLIDING:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = attend_tile(q, K_cache, V_cache, kv_offsets, kv_mask, visible,
                                    m_i, l_i, acc, qk_scale, cap_log2, PRECISION, UPCAST_DOT,
                                    SOFTCAP, MASK_SCORES=MASKED)
    return m_i, l_i, acc


@triton.jit
def _prefill_kernel(
    Q, K_cache, V_cache, Block_tables, Seq_lens, Query_start_loc, Out, qk_scale, cap_log2,
    window, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_b, stride_s, stride_h,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    kv_head = tl.program_id(1)
    tile_idx = tl.program_id(0) + tl.load(Query_start_loc) // BLOCK_Q
    seq = _find_sequence(Query_start_loc, tile_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(Query_start_loc + seq)
    q_len = tl.load(Query_start_loc + seq + 1) - q_start
    tile = tile_idx - (q_start // BLOCK_Q + seq)
    seq_len = tl.load(Seq_lens + seq).to(tl.int32)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * BLOCK_G)  # row = token * BLOCK_G + head within the group
    tok = tile * BLOCK_Q + rows // BLOCK_G
    grp = rows % BLOCK_G
    heads = kv_head * GROUP + grp
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = ((tok < q_len) & (grp < GROUP))[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=row_mask, other=0.0)
    q_pos = ctx_len + tok
    kv_end = tl.minimum(seq_len, ctx_len + (tile + 1) * BLOCK_Q)
    kv_end = tl.where(tile * BLOCK_Q < q_len, kv_end, 0)  # an unused tile slot: no work

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    table_row = Block_tables + seq * stride_bt
    kv_start = 0
    # Key tiles before ``full_end`` are seen whole by every query of the tile (their last key
    # is at or before the tile's first query), so they skip the causal mask; the tiles from
    # there to ``kv_end`` are masked. Both loops step by BLOCK_N from kv_start: the same tiles
    # in the same order as one masked loop, so the same bits. With a sliding window every tile
    # is masked (a later query's window may start inside any of them).
    if SLIDING:  # the tile's first query sees nothing before this; no earlier block is read
        kv_start = tl.maximum(ctx_len + tile * BLOCK_Q - window + 1, 0)
        full_end = kv_start
    else:
        full_end = tl.minimum(ctx_len + tile * BLOCK_Q + 1, kv_end) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = _attend_keys(
        q, K_cache, V_cache, table_row, kv_head, stride_b, stride_s, stride_h, kv_start,
        full_end, kv_end, q_pos, window, m_i, l_i, acc, qk_scale, cap_log2, BLOCK_SIZE,
        HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, UPCAST_DOT, SOFTCAP, False, SLIDING)
    m_i, l_i, acc = _attend_keys(
        q, K_cache, V_cache, table_row, kv_head, stride_b, stride_s, stride_h, full_end,
        kv_end, kv_end, q_pos, window, m_i, l_i, acc, qk_scale, cap_log2, BLOCK_SIZE,
        HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, UPCAST_DOT, SOFTCAP, True, SLIDING)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = Out + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out, (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=row_mask)


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
    *, sliding_window: int | None = None, softcap: float | None = None,
    out: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed variable-length query chunks over their paged K/V.

    q: ``[num_tokens, num_heads, head_dim]`` (float32/float16/bfloat16, last dim contiguous);
    k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype, equal
    strides, this step's K/V already written; block_tables: ``[num_seqs, max_blocks]``
    int32/int64; seq_lens: ``[num_seqs]`` int, context length including the chunk;
    query_start_loc: ``[num_seqs + 1]`` int32, non-decreasing absolute row offsets into q and
    out (rows outside every sequence are left untouched); max_query_len: the longest chunk
    (tokens; only bounds the grid and may be larger); sliding_window W: a query at position p
    sees keys ``p - W < k <= p`` and blocks before every window of a tile are not read;
    softcap c: scores become ``c * tanh(s / c)``. block_m / block_n: rows and keys per tile;
    num_warps / num_stages: Triton's launch options (default: Triton's warps, 2 stages on a
    GPU); all four for tuning
    (``python -m kernels.bench --prefill-configs``). Returns ``out`` (q's shape and dtype).
    Same result as ``kernels.reference.paged_prefill_attention``. Raises ``ValueError`` on bad
    arguments.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = len(seq_lens)
    check_attention_args(q, k_cache, v_cache, block_tables, seq_lens)
    check_devices(q, query_start_loc)
    if len(query_start_loc) != num_seqs + 1:
        raise ValueError(f"query_start_loc has {len(query_start_loc)} entries, "
                         f"expected {num_seqs + 1}")
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    block_g = next_power_of_2(group)
    block_m = block_m or (64 if q.is_cuda else 16)
    block_n = block_n or _default_block_n(q.dtype, head_dim)
    # two pipeline stages, not Triton's three: on an H200 (bf16, head_dim 128) 2.6-9.5% faster
    # on 2,048- and 8,192-token prompts and 512-token chunks after them, with the same bits
    # (stages do not reorder the sums) and less shared memory (kernels.bench
    # --prefill-configs, docs/benchmarks.md's GPU section)
    num_stages = num_stages or (2 if q.is_cuda else None)
    block_q = max(1, min(block_m // block_g, next_power_of_2(max_query_len)))
    if block_q * block_g < 16:  # NOTE: an MMA tile has 16 rows; fewer would be padded anyway
        block_q = 16 // block_g
    # tile slots in use <= tokens // block_q + num_seqs + 1 (offsets need not start at 0)
    num_slots = min(num_tokens, num_seqs * max_query_len) // block_q + num_seqs + 1
    grid = (num_slots, num_kv_heads)
    qk_scale, cap_log2 = score_scales(scale, softcap)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, qk_scale, cap_log2,
        sliding_window or 0, num_seqs, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), *k_cache.stride()[:3],
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BLOCK_Q=block_q,
        BLOCK_N=block_n, SLIDING=sliding_window is not None, SOFTCAP=bool(softcap),
        **dot_options(q.dtype, q.device), **launch_options(num_warps, num_stages))
    return out


def _default_block_n(dtype: torch.dtype, head_dim: int) -> int:
    """Keys per tile: 64, or 32 where 64 would need more shared memory than consumer GPUs
    (~100 KiB on sm_86/89) have (float32 operands, head_dim > 128)."""
    return 32 if dtype == torch.float32 or head_dim > 128 else 64
