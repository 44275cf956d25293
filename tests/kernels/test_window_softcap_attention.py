"""Sliding-window and soft-capped attention (Mistral, Gemma): the torch reference against a
dense float64 computation of Hugging Face's semantics, the Triton kernels against the
reference, and blocks wholly before the window never read (their table entries may point at
freed blocks). On CPU the Triton kernels run in the interpreter (small shapes)."""
from __future__ import annotations

import math

import pytest
import torch

from kernels import reference

from .conftest import ATOL, DTYPES, HAS_CUDA, make_paged_batch, reference_in_float32

HEAD_DIM = 32 if not HAS_CUDA else 128
BLOCK_N = 16 if not HAS_CUDA else None
DECODES = [(6, 1), (15, 1), (0, 1), (39, 1)]
CHUNKS = [(0, 1), (0, 17), (5, 11), (16, 16), (31, 2)]
# (window, softcap): Mistral-like, Gemma 2's local layer, a global soft-capped one, a window
# shorter than a block
SETTINGS = [(8, None), (10, 50.0), (None, 5.0), (3, None)]


def dense(q, keys, values, ctx, window, softcap, scale):
    """Hugging Face's eager attention in float64 for one sequence: queries at positions
    ``ctx ..``; key k visible from query p iff ``k <= p`` and ``k > p - window``."""
    n, h, _ = q.shape
    group = h // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,khd->hnk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos_q = torch.arange(ctx, ctx + n).unsqueeze(1)
    pos_k = torch.arange(keys.shape[0]).unsqueeze(0)
    visible = pos_k <= pos_q
    if window is not None:
        visible &= pos_k > pos_q - window
    scores = scores.masked_fill(~visible, -math.inf)
    return torch.einsum("hnk,khd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window,softcap", SETTINGS)
def test_reference_is_hugging_faces_semantics(window, softcap):
    seqs = DECODES + CHUNKS
    batch = make_paged_batch(seqs, 6, 2, HEAD_DIM, 4, device=torch.device("cpu"))
    nd = len(DECODES)
    got = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                    batch.seq_lens, batch.query_start_loc, nd, batch.scale,
                                    sliding_window=window, softcap=softcap)
    for i, (ctx, n) in enumerate(seqs):
        rows = slice(batch.query_start_loc[i], batch.query_start_loc[i + 1])
        want = dense(batch.q[rows], batch.keys[i], batch.values[i], ctx, window, softcap,
                     batch.scale)
        torch.testing.assert_close(got[rows].double(), want, atol=1e-5, rtol=0)


def poison_outside_windows(batch, window, nd):
    """Point every table entry wholly before each sequence's earliest window at a block of
    NaNs (what a freed, reused block may hold), as the block manager leaves freed entries."""
    bs = batch.k_cache.shape[1]
    k_cache = torch.cat([batch.k_cache, torch.full_like(batch.k_cache[:1], math.nan)])
    v_cache = torch.cat([batch.v_cache, torch.full_like(batch.v_cache[:1], math.nan)])
    tables = batch.block_tables.clone()
    locs = batch.query_start_loc
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        n = locs[i + 1] - locs[i]
        first_needed = max(0, seq_len - n - window + 1)
        tables[i, :first_needed // bs] = k_cache.shape[0] - 1
    return k_cache, v_cache, tables


@pytest.mark.parametrize("window,softcap", [(8, None), (10, 50.0)])
def test_reference_reads_no_block_before_the_window(window, softcap):
    batch = make_paged_batch(DECODES + CHUNKS, 6, 2, HEAD_DIM, 4, device=torch.device("cpu"))
    nd = len(DECODES)
    k_cache, v_cache, tables = poison_outside_windows(batch, window, nd)
    assert not torch.equal(tables, batch.block_tables)
    args = (batch.seq_lens, batch.query_start_loc, nd, batch.scale)
    want = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                     *args, sliding_window=window, softcap=softcap)
    got = reference.paged_attention(batch.q, k_cache, v_cache, tables, *args,
                                    sliding_window=window, softcap=softcap)
    assert torch.equal(got, want)


triton = pytest.importorskip("triton", reason="triton is not installed: Triton kernels not tested")
from kernels.decode_attention import paged_decode_attention  # noqa: E402
from kernels.paged_attention import paged_attention  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window,softcap", SETTINGS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_triton_ragged_batch_matches_reference(block_size, window, softcap, dtype):
    batch = make_paged_batch(DECODES + CHUNKS, 6, 2, HEAD_DIM, block_size, dtype)
    nd = len(DECODES)
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                          batch.seq_lens, batch.query_start_loc_tensor(), batch.max_query_len,
                          nd, batch.scale, sliding_window=window, softcap=softcap)
    expected = reference_in_float32(reference.paged_attention, batch, batch.block_tables,
                                    batch.seq_lens, batch.query_start_loc, nd, batch.scale,
                                    window, softcap)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("max_splits", [1, 3])
def test_triton_decode_splits_cover_only_the_window(max_splits):
    lens = [1, 16, 17, 40]
    batch = make_paged_batch([(n - 1, 1) for n in lens], 8, 2, HEAD_DIM, 4)
    k_cache, v_cache, tables = poison_outside_windows(batch, 9, len(lens))
    out = paged_decode_attention(batch.q, k_cache, v_cache, tables, batch.seq_lens, batch.scale,
                                 sliding_window=9, max_splits=max_splits, block_n=BLOCK_N)
    expected = reference_in_float32(reference.paged_decode_attention, batch, batch.block_tables,
                                    batch.seq_lens, batch.scale, 8, 9)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[torch.float32], rtol=0)


def test_triton_prefill_reads_no_block_before_the_window():
    batch = make_paged_batch(DECODES + CHUNKS, 6, 2, HEAD_DIM, 4)
    nd = len(DECODES)
    k_cache, v_cache, tables = poison_outside_windows(batch, 6, nd)
    out = paged_attention(batch.q, k_cache, v_cache, tables, batch.seq_lens,
                          batch.query_start_loc_tensor(), batch.max_query_len, nd, batch.scale,
                          sliding_window=6)
    expected = reference_in_float32(reference.paged_attention, batch, batch.block_tables,
                                    batch.seq_lens, batch.query_start_loc, nd, batch.scale, 6)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[torch.float32], rtol=0)
