"""Paged decode attention in Triton: one query token per sequence, split-K over the context.

Algorithm: flash-decoding (Dao et al., "Flash-Decoding for long-context inference", 2023), the
two-stage form of LightLLM's / SGLang's Triton decode kernels. Stage 1 computes each
(sequence, KV head, split) alone; its program holds all ``num_heads // num_kv_heads`` query
heads of its KV head as the rows of one ``tl.dot`` (so each K/V tile is loaded once for the whole group),
walks its share of the context through the block table with an online softmax, and writes a
partial output and its log-sum-exp. Stage 2 merges the splits in a fixed order. With one
split, stage 1 writes the normalized output directly and stage 2 is skipped. The fused merge
(``fused_merge``, ``FUSED_MERGE``) saves stage 2's launch, a few microseconds a layer under a
CUDA graph: the last of a row's stage-1 programs to finish merges the row, as serial split-K
GEMMs fix up their partial tiles (an arrival counter per row, acquire/release atomics).

Batch invariance: how a sequence's context is split depends on its own length alone (as in
vLLM's batch-invariant mode and SGLang's deterministic inference, where split sizes are fixed
per sequence rather than chosen to fill the GPU): ``max(ceil(tiles / max_splits), min_tiles)``
key tiles per split, so at most ``max_splits`` splits, and the merge reduces a fixed-size
vector of ``max_splits`` slots. So a sequence's output is the same bits whatever else is in
the batch, however wide the block table (CUDA graphs pass the model's full width) and whichever
path (split or direct) the batch takes. The most splits a sequence may use comes from the
block table's width; the merge, which counts a sequence's splits from its length as stage 1
does, adds the slots stage 1 never wrote as exact zeros. Stage 1's grid has a program per split
when the batch is small and fewer once the batch fills the GPU (``choose_split_programs``),
each program then taking every n-th split of its sequence in turn: under a CUDA graph (the
model's full table width) a program per possible split would be mostly programs that only read
a length. The price of fixed split sizes: a large batch of short contexts is split where
filling the GPU would not need it (measured in docs/benchmarks.md).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ._attention_tile import attend_tile, kv_tile_offsets, score_scales
from ._launch import check_attention_args, dot_options, next_power_of_2

MAX_SPLITS = 32  # splits per sequence at most
MIN_TILES_PER_SPLIT = 2  # key tiles: a shorter split costs more to write and merge than it saves
PROGRAMS_PER_SM = 8  # stage 1's grid: about this many programs per multiprocessor, batch-wide
# the merge in stage 1's last program of each (sequence, KV head) instead of a second launch;
# off until timed on a GPU (docs/benchmarks.md, GPU section: kernels.bench --merge)
FUSED_MERGE = False


@triton.jit
def _sequence_splits(seq_len, window, max_splits, BLOCK_N: tl.constexpr,
                     MIN_TILES: tl.constexpr, SLIDING: tl.constexpr):
    """(first key position, keys per split, splits used) of a sequence of ``seq_len`` keys,
    from its length alone, so the same whatever the batch; both stages call it, so the merge
    reads exactly the splits stage 1 wrote."""
    lo = 0
    if SLIDING:  # the query (position seq_len - 1) sees the last ``window`` keys
        lo = tl.maximum(seq_len - window, 0)
    tiles = tl.cdiv(seq_len - lo, BLOCK_N)
    split_tiles = tl.maximum(tl.cdiv(tiles, max_splits), MIN_TILES)
    return lo, split_tiles * BLOCK_N, tl.cdiv(tiles, split_tiles)


@triton.jit
def _decode_split_kernel(
    Q, K_cache, V_cache, Block_tables, Seq_lens, Out, Lse, Final, Arrivals, qk_scale, cap_log2,
    window, max_splits, stride_qs, stride_qh, stride_bt, stride_b, stride_s, stride_h,
    stride_os, stride_oh, stride_ok, stride_ls, stride_lh, stride_fs, stride_fh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr, FUSED_MERGE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Stage 1 (module docstring). ``FUSED_MERGE``: the row's last program to finish (counted
    in ``Arrivals``, one int32 per (sequence, KV head), zero before and after) also merges the
    row's heads into ``Final``, so no second launch; ``Out``/``Lse`` are then the scratch."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(Seq_lens + seq)
    lo, split_len, used = _sequence_splits(seq_len, window, max_splits, BLOCK_N, MIN_TILES,
                                           SLIDING)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    row_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask, other=0.0)
    table_row = Block_tables + seq * stride_bt
    # the grid's split axis may be narrower than the sequence's splits: each program takes
    # every num_programs-th split, each computed alone, so the bits do not depend on the grid;
    # a program past the sequence's last split does nothing (the merge leaves those slots out)
    for split in range(tl.program_id(2), used, tl.num_programs(2)):
        start = lo + split * split_len
        end = tl.minimum(start + split_len, seq_len)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            kv_offsets, kv_mask = kv_tile_offsets(table_row, pos, end, kv_head, stride_b,
                                                  stride_s, stride_h, BLOCK_SIZE, HEAD_DIM,
                                                  BLOCK_D)
            m_i, l_i, acc = attend_tile(q, K_cache, V_cache, kv_offsets, kv_mask,
                                        (pos < end)[None, :], m_i, l_i, acc, qk_scale, cap_log2,
                                        PRECISION, UPCAST_DOT, SOFTCAP)
        out = (Out + seq * stride_os + heads[:, None] * stride_oh + split * stride_ok
               + offs_d[None, :])
        tl.store(out, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=row_mask)
        if SPLIT:
            lse = Lse + seq * stride_ls + heads * stride_lh + split
            tl.store(lse, m_i + tl.log2(l_i), mask=offs_g < GROUP)
    if FUSED_MERGE:
        # the split-K "semaphore" (CUTLASS's serial split-K, stream-K's fix-up): every thread's
        # stores are done (barrier) before the release of the arrival; the last to arrive
        # acquires the others' partials. The counter is reset for the next launch.
        tl.debug_barrier()
        arrival = Arrivals + seq * tl.num_programs(1) + kv_head
        if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") == tl.num_programs(2) - 1:
            tl.debug_barrier()
            for g in tl.static_range(GROUP):
                _merge_head(Out, Lse, Final, seq, kv_head * GROUP + g, used, stride_os,
                            stride_oh, stride_ok, stride_ls, stride_lh, stride_fs, stride_fh,
                            HEAD_DIM, BLOCK_D, BLOCK_K)
            tl.store(arrival, 0)


@triton.jit
def _merge_head(Partial, Lse, Out, seq, head, used,
                stride_ps, stride_ph, stride_pk, stride_ls, stride_lh, stride_os, stride_oh,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
    """Softmax-weighted sum of one (sequence, head)'s ``used`` splits. ``BLOCK_K`` comes from
    ``max_splits``, not from the grid's split count, so the reduction has the same shape (and
    order) in every batch; the slots past the sequence's own splits (counted from its length,
    as stage 1 splits it, and never written) enter as exact zeros (weight 0, partial 0). The
    loads skip the L1 cache (``.cg``): under the fused merge other programs wrote them."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    mask_k = offs_k < used
    lse = tl.load(Lse + seq * stride_ls + head * stride_lh + offs_k, mask=mask_k,
                  other=float("-inf"), cache_modifier=".cg")
    weight = tl.exp2(lse - tl.max(lse, 0))
    partial_ptrs = (Partial + seq * stride_ps + head * stride_ph + offs_k[:, None] * stride_pk
                    + offs_d[None, :])
    partial = tl.load(partial_ptrs, mask=mask_k[:, None] & (offs_d < HEAD_DIM)[None, :],
                      other=0.0, cache_modifier=".cg")
    out = tl.sum(partial * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(Out + seq * stride_os + head * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def _decode_merge_kernel(
    Partial, Lse, Out, Seq_lens, window, max_splits,
    stride_ps, stride_ph, stride_pk, stride_ls, stride_lh, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_TILES: tl.constexpr, SLIDING: tl.constexpr,
):
    """Stage 2: one program per (sequence, head), ``_merge_head``."""
    seq = tl.program_id(0)
    _, _, used = _sequence_splits(tl.load(Seq_lens + seq), window, max_splits, BLOCK_N,
                                  MIN_TILES, SLIDING)
    _merge_head(Partial, Lse, Out, seq, tl.program_id(1), used, stride_ps, stride_ph, stride_pk,
                stride_ls, stride_lh, stride_os, stride_oh, HEAD_DIM, BLOCK_D, BLOCK_K)


def default_block_n(head_dim: int) -> int:
    """Keys per tile: 64, or 32 for heads wider than 128 (registers)."""
    return 64 if head_dim <= 128 else 32


def choose_num_splits(max_context: int, block_n: int, max_splits: int = MAX_SPLITS,
                      min_tiles: int = MIN_TILES_PER_SPLIT) -> int:
    """The grid's split axis: splits of the longest possible context (``max_context`` tokens,
    an upper bound such as the block table's width), each at least ``min_tiles`` key tiles of
    ``block_n``, at most ``max_splits``. Each sequence uses as many as its own length needs."""
    return max(1, min(max_splits, math.ceil(max_context / (block_n * min_tiles))))


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs one program at a time
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_split_programs(num_rows: int, splits: int, device: torch.device) -> int:
    """Stage 1's programs per (sequence, KV head) row: the grid's split axis. ``splits`` (the
    most any sequence of the batch may use, ``choose_num_splits``) when the batch is small;
    fewer once ``num_rows`` rows fill the GPU (about ``PROGRAMS_PER_SM`` programs per
    multiprocessor), each program then taking several splits in turn. Under a CUDA graph the
    split axis is sized for the table's full width while most sequences use a few splits, so a
    grid of ``splits`` per row would be mostly programs that only read a length (at batch 256
    with the built-in model, 97% of 24,576). Each split is computed alone whichever program
    takes it, so the bits do not depend on this."""
    target = PROGRAMS_PER_SM * _multiprocessors(device)
    return max(1, min(splits, math.ceil(target / num_rows)))


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, *, sliding_window: int | None = None,
    softcap: float | None = None, max_splits: int = MAX_SPLITS,
    min_tiles: int = MIN_TILES_PER_SPLIT, block_n: int | None = None,
    split_programs: int | None = None, fused_merge: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V.

    q: ``[num_seqs, num_heads, head_dim]`` (float32/float16/bfloat16, last dim contiguous);
    k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype, equal
    strides; block_tables: ``[num_seqs, max_blocks]`` int32/int64; seq_lens: ``[num_seqs]``
    int, each >= 1 (positions ``0 .. seq_len - 1`` are attended; with ``sliding_window`` W only
    the last W, and no block before them is read); scale: softmax scale; softcap c: scores
    become ``c * tanh(s / c)``. max_splits / min_tiles / block_n: override the most splits per
    sequence, the fewest key tiles per split and the key-tile size (tests, tuning); a
    sequence's output depends on them and its own K/V, never on the rest of the batch.
    split_programs: override stage 1's programs per (sequence, KV head) (tests, tuning); the
    output does not depend on it. fused_merge: merge the splits in stage 1's last program of
    each (sequence, KV head) rather than in a second kernel (default ``FUSED_MERGE``; tests,
    tuning); on the interpreter the output is the same bits either way, on a GPU each way
    keeps its own bits in every batch. Returns ``out`` (``[num_seqs, num_heads, head_dim]``, q's
    dtype), written in place if given. Same result as ``kernels.reference.paged_decode_attention``. Raises ``ValueError`` on
    mismatched shapes, dtypes or devices.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_attention_args(q, k_cache, v_cache, block_tables, seq_lens)
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    context = block_tables.shape[1] * block_size
    if sliding_window is not None:
        context = min(context, sliding_window + block_size)
    block_n = block_n or default_block_n(head_dim)
    splits = choose_num_splits(context, block_n, max_splits, min_tiles)
    group = num_heads // num_kv_heads
    meta = dict(GROUP=group, BLOCK_G=max(16, next_power_of_2(group)), HEAD_DIM=head_dim,
                BLOCK_D=max(16, next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
                BLOCK_N=block_n, MIN_TILES=min_tiles, SPLIT=splits > 1,
                SLIDING=sliding_window is not None, SOFTCAP=bool(softcap),
                BLOCK_K=next_power_of_2(max_splits), **dot_options(q.dtype, q.device))
    programs = split_programs or choose_split_programs(num_seqs * num_kv_heads, splits, q.device)
    grid = (num_seqs, num_kv_heads, min(programs, splits))
    args = (q, k_cache, v_cache, block_tables, seq_lens)
    scalars = (*score_scales(scale, softcap), sliding_window or 0, max_splits,
               q.stride(0), q.stride(1), block_tables.stride(0), *k_cache.stride()[:3])
    if splits == 1:
        _decode_split_kernel[grid](*args, out, out, out, seq_lens, *scalars, out.stride(0),
                                   out.stride(1), 0, 0, 0, 0, 0, FUSED_MERGE=False, **meta)
    else:
        fused = FUSED_MERGE if fused_merge is None else fused_merge
        _split_and_merge(grid, args, scalars, out, splits, fused, meta)
    return out


def _split_and_merge(grid: tuple[int, int, int], args: tuple, scalars: tuple, out: torch.Tensor,
                     splits: int, fused: bool, meta: dict) -> None:
    """``paged_decode_attention``'s two stages into float32 scratch (``[num_seqs, num_heads,
    splits, head_dim]`` partials and ``[num_seqs, num_heads, splits]`` log-sum-exps), the merge
    by a second kernel or by stage 1 itself (``fused``)."""
    (num_seqs, num_heads, head_dim), seq_lens = out.shape, args[4]
    partial = torch.empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32,
                          device=out.device)
    lse = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=out.device)
    arrivals = arrival_counters(out.device, num_seqs * grid[1]) if fused else seq_lens
    _decode_split_kernel[grid](*args, partial, lse, out, arrivals, *scalars,
                               *partial.stride()[:3], *lse.stride()[:2], out.stride(0),
                               out.stride(1), FUSED_MERGE=fused, **meta)
    if not fused:
        window, max_splits = scalars[2], scalars[3]
        _decode_merge_kernel[(num_seqs, num_heads)](
            partial, lse, out, seq_lens, window, max_splits, *partial.stride()[:3],
            *lse.stride()[:2], out.stride(0), out.stride(1), HEAD_DIM=head_dim,
            BLOCK_D=meta["BLOCK_D"], BLOCK_K=meta["BLOCK_K"], BLOCK_N=meta["BLOCK_N"],
            MIN_TILES=meta["MIN_TILES"], SLIDING=meta["SLIDING"])


# device -> int32 counters, zero between launches (each launch's merging programs reset theirs)
_ARRIVALS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown counters stay allocated: a captured graph holds them


def arrival_counters(device: torch.device, rows: int) -> torch.Tensor:
    """The fused merge's arrival counters, one int32 per (sequence, KV head), at least ``rows``
    of them, all zero: one buffer per device, allocated at first use (at least 16,384 rows,
    64 KiB, so a CUDA graph captured later finds it) and regrown only for a larger batch.
    Launches that overlap on one device (two streams) must not share it; the engine launches
    attention from one stream."""
    counters = _ARRIVALS.get(device)
    if counters is None or counters.numel() < rows:
        if counters is not None:
            _RETIRED.append(counters)
        counters = torch.zeros(max(rows, 16384), dtype=torch.int32, device=device)
        _ARRIVALS[device] = counters
    return counters

