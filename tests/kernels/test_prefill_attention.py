"""Triton prefill / chunked-prefill attention and the whole ragged batch vs the references.

On CPU the kernels run in Triton's interpreter (small shapes); on CUDA, larger ones.
"""
from __future__ import annotations

import pytest
import torch

from kernels import reference

from .conftest import ATOL, DTYPES, HAS_CUDA, make_paged_batch, reference_in_float32

pytest.importorskip("triton", reason="triton is not installed: Triton kernels not tested")
from kernels.paged_attention import paged_attention  # noqa: E402
from kernels.prefill_attention import paged_prefill_attention  # noqa: E402

# (cached prefix, chunk): a one-token prompt, a prompt one past a block, a prefix hit with a
# chunk across a block boundary, a one-block prefix + a one-block chunk, a short late chunk
CHUNKS = ([(0, 1), (0, 17), (5, 11), (16, 16), (31, 2)] if not HAS_CUDA else
          [(0, 1), (0, 17), (5, 11), (16, 16), (31, 2), (0, 1000), (512, 256), (3000, 77)])
DECODES = [(6, 1), (15, 1), (0, 1)] if not HAS_CUDA else [(6, 1), (15, 1), (0, 1), (4000, 1)]
HEAD_DIM = 32 if not HAS_CUDA else 128
BLOCK_N = 16 if not HAS_CUDA else None  # small key tiles: several per query tile on CPU


def expected_prefill(batch):
    return reference_in_float32(reference.paged_prefill_attention, batch, batch.block_tables,
                                batch.seq_lens, batch.query_start_loc, batch.scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_matches_reference(block_size, num_heads, num_kv_heads, dtype):
    batch = make_paged_batch(CHUNKS, num_heads, num_kv_heads, HEAD_DIM, block_size, dtype)
    out = paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                  batch.seq_lens, batch.query_start_loc_tensor(),
                                  batch.max_query_len, batch.scale, block_n=BLOCK_N)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected_prefill(batch), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("head_dim", [40, 64])
def test_prefill_tile_shapes_and_head_dims(head_dim, block_m):
    batch = make_paged_batch(CHUNKS, 9, 3, head_dim, 16)
    out = paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                  batch.seq_lens, batch.query_start_loc_tensor(),
                                  batch.max_query_len, batch.scale, block_m=block_m,
                                  block_n=BLOCK_N)
    torch.testing.assert_close(out, expected_prefill(batch), atol=ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(3, 1), (6, 2)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_mixed_batch_matches_reference(block_size, num_heads, num_kv_heads, dtype):
    """Decodes first, then prefills at row offsets that are not tile-aligned."""
    batch = make_paged_batch(DECODES + CHUNKS, num_heads, num_kv_heads, HEAD_DIM, block_size,
                             dtype)
    nd = len(DECODES)
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                          batch.seq_lens, batch.query_start_loc_tensor(), batch.max_query_len,
                          nd, batch.scale)
    expected = reference_in_float32(reference.paged_attention, batch, batch.block_tables,
                                    batch.seq_lens, batch.query_start_loc, nd, batch.scale)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)


def test_prefill_leaves_rows_outside_sequences_untouched():
    batch = make_paged_batch([(2, 1), (0, 9), (4, 5)], 4, 2, HEAD_DIM, 4)
    out = torch.full_like(batch.q, 7.0)
    locs = batch.query_start_loc_tensor()[1:]  # skip the first sequence (row 0)
    paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables[1:],
                            batch.seq_lens[1:], locs, 9, batch.scale, out=out, block_n=BLOCK_N)
    assert (out[0] == 7.0).all()
    torch.testing.assert_close(out[1:], expected_prefill(batch)[1:], atol=ATOL[torch.float32], rtol=0)


def test_all_decode_and_all_prefill_batches():
    for seqs, nd in ((DECODES, len(DECODES)), (CHUNKS, 0)):
        batch = make_paged_batch(seqs, 4, 2, HEAD_DIM, 16)
        out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                              batch.seq_lens, batch.query_start_loc_tensor(),
                              batch.max_query_len, nd, batch.scale)
        expected = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache,
                                             batch.block_tables, batch.seq_lens,
                                             batch.query_start_loc, nd, batch.scale)
        torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=0)


def test_prefill_grid_covers_unaligned_offsets():
    """Rows 7 and 8 straddle a query-tile boundary (8 rows a tile here): the tile slots of a
    batch whose offsets do not start at 0 need one more program than tokens // tile + seqs."""
    batch = make_paged_batch([(1, 1)] * 7 + [(0, 1), (3, 1)], 4, 2, HEAD_DIM, 4)
    out = torch.zeros_like(batch.q)
    paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables[7:],
                            batch.seq_lens[7:], batch.query_start_loc_tensor()[7:], 1,
                            batch.scale, out=out, block_n=BLOCK_N)
    torch.testing.assert_close(out[7:], expected_prefill(batch)[7:], atol=ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 7])
def test_a_cuda_graph_s_padded_prefill_gives_the_same_bits(window, dtype):
    """A prefill step as a CUDA graph's bucket runs it (services/engine/cuda_graphs.py):
    padding rows after the step's tokens, padding sequences with no token and length 0, and
    the grid bounded by the bucket (``max_query_len`` = its tokens: query tiles of 16 tokens
    here where the step's own call, its longest chunk 8 tokens, takes 8). Each real row is
    the same bits as the step's own call, and the padding rows are not written."""
    chunks = [(0, 1), (5, 3), (16, 8), (31, 2), (9, 7)]
    batch = make_paged_batch(chunks, 4, 2, HEAD_DIM, 16, dtype)
    n, m = batch.q.shape[0], len(chunks)
    tokens = 2 * n + 5
    eager = paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                    batch.seq_lens, batch.query_start_loc_tensor(),
                                    batch.max_query_len, batch.scale, sliding_window=window,
                                    block_m=32, block_n=BLOCK_N)
    q = torch.cat([batch.q, torch.randn(tokens - n, *batch.q.shape[1:]).to(batch.q)])
    tables = torch.cat([batch.block_tables, batch.block_tables[:3].flip(1)])
    seq_lens = torch.cat([batch.seq_lens, batch.seq_lens.new_zeros(3)])
    locs = torch.tensor(batch.query_start_loc + [n] * 3, dtype=torch.int32, device=q.device)
    out = torch.full_like(q, 7.0)
    paged_prefill_attention(q, batch.k_cache, batch.v_cache, tables, seq_lens, locs, tokens,
                            batch.scale, sliding_window=window, out=out, block_m=32,
                            block_n=BLOCK_N)
    assert torch.equal(out[:n], eager)
    assert (out[n:] == 7.0).all()
