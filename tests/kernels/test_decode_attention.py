"""Triton paged decode attention vs ``kernels.reference.paged_decode_attention``.

On CPU the kernel runs in Triton's interpreter (small shapes); on CUDA, larger ones.
"""
from __future__ import annotations

import pytest
import torch

from kernels import reference

from .conftest import ATOL, DTYPES, HAS_CUDA, make_paged_batch, reference_in_float32

pytest.importorskip("triton", reason="triton is not installed: Triton kernels not tested")
import kernels.decode_attention as decode_attention  # noqa: E402
from kernels.decode_attention import (  # noqa: E402
    arrival_counters, choose_num_splits, choose_split_programs, paged_decode_attention)

# context lengths: a single token, exactly one block, one past it, several blocks
LENS = [1, 16, 17, 40] if not HAS_CUDA else [1, 16, 17, 255, 1000, 4097]
HEAD_DIM = 32 if not HAS_CUDA else 128
BLOCK_N = 16 if not HAS_CUDA else None  # small key tiles: several tiles per split on CPU


def check(batch, dtype, **kwargs):
    out = paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                 batch.seq_lens, batch.scale, block_n=BLOCK_N, **kwargs)
    expected = reference_in_float32(reference.paged_decode_attention, batch, batch.block_tables,
                                    batch.seq_lens, batch.scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("max_splits", [1, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_matches_reference(block_size, num_heads, num_kv_heads, max_splits, dtype):
    batch = make_paged_batch([(n - 1, 1) for n in LENS], num_heads, num_kv_heads, HEAD_DIM,
                             block_size, dtype)
    check(batch, dtype, max_splits=max_splits)


@pytest.mark.parametrize("head_dim", [40, 64])
def test_decode_head_dims(head_dim):
    """head_dim padded to the next power of two (40), and the default model's (64)."""
    batch = make_paged_batch([(n - 1, 1) for n in LENS], 9, 3, head_dim, 16)
    check(batch, torch.float32, max_splits=2)


def test_decode_more_splits_than_tiles_and_default_splits():
    batch = make_paged_batch([(0, 1), (4, 1)], 4, 1, HEAD_DIM, 4)
    check(batch, torch.float32, max_splits=8)
    check(batch, torch.float32)


@pytest.mark.parametrize("fused_merge", [False, True])
@pytest.mark.parametrize("split_programs", [None, 1, 2])
def test_splits_past_a_sequence_s_end_are_neither_written_nor_read(monkeypatch, split_programs,
                                                                   fused_merge):
    """Under a wide block table most grid splits lie past a short sequence's end: stage 1 skips
    them and the merge leaves them out, so scratch the kernels never wrote (NaN here, garbage
    in torch.empty) cannot reach the output, with or without a sliding window, whichever
    program merges."""
    monkeypatch.setattr(decode_attention, "FUSED_MERGE", fused_merge)

    def nan_empty(*shape, **kwargs):
        return torch.full(*shape, float("nan"), **kwargs)

    monkeypatch.setattr(decode_attention.torch, "empty", nan_empty)
    batch = make_paged_batch([(n - 1, 1) for n in LENS], 6, 2, HEAD_DIM, 4)
    wide = torch.zeros(len(LENS), 8 * batch.block_tables.shape[1],
                       dtype=batch.block_tables.dtype, device=batch.block_tables.device)
    wide[:, :batch.block_tables.shape[1]] = batch.block_tables
    out = paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, wide, batch.seq_lens,
                                 batch.scale, block_n=BLOCK_N, min_tiles=1, out=batch.q * 0,
                                 split_programs=split_programs)
    expected = reference.paged_decode_attention(batch.q, batch.k_cache, batch.v_cache,
                                                batch.block_tables, batch.seq_lens, batch.scale)
    torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=0)
    out = paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, wide, batch.seq_lens,
                                 batch.scale, block_n=BLOCK_N, min_tiles=1, sliding_window=5,
                                 out=batch.q * 0, split_programs=split_programs)
    expected = reference.paged_decode_attention(batch.q, batch.k_cache, batch.v_cache,
                                                batch.block_tables, batch.seq_lens, batch.scale,
                                                sliding_window=5)
    torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=0)


def test_decode_writes_into_out_view():
    batch = make_paged_batch([(n - 1, 1) for n in LENS], 4, 2, HEAD_DIM, 16)
    full = torch.zeros(len(LENS) + 2, 4, HEAD_DIM, device=batch.q.device)
    paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                           batch.seq_lens, batch.scale, out=full[:len(LENS)], block_n=BLOCK_N)
    expected = reference.paged_decode_attention(batch.q, batch.k_cache, batch.v_cache,
                                                batch.block_tables, batch.seq_lens, batch.scale)
    torch.testing.assert_close(full[:len(LENS)], expected, atol=ATOL[torch.float32], rtol=0)
    assert not full[len(LENS):].any()


def test_choose_num_splits():
    assert choose_num_splits(8192, 64) == 32  # capped
    assert choose_num_splits(300, 64) == 3  # at least two key tiles per split
    assert choose_num_splits(300, 64, min_tiles=1) == 5
    assert choose_num_splits(128, 64) == 1 and choose_num_splits(8192, 64, max_splits=1) == 1


def test_choose_split_programs():
    cpu = torch.device("cpu")  # one multiprocessor: about 8 programs batch-wide
    assert choose_split_programs(1, 32, cpu) == 8
    assert choose_split_programs(3, 32, cpu) == 3  # ceil(8 / 3)
    assert choose_split_programs(3, 2, cpu) == 2  # never more than the splits
    assert choose_split_programs(64, 32, cpu) == 1  # the batch alone fills it


@pytest.mark.parametrize("fused_merge", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_sequence_gets_the_same_bits_in_any_batch(dtype, fused_merge):
    """Batch invariance: each sequence's output, computed alone (its own block table width,
    so fewer grid splits), equals bit for bit its row in the whole batch, and in the batch
    with a block table four times as wide (as CUDA graphs pass it); with either merge."""
    batch = make_paged_batch([(n - 1, 1) for n in LENS], 8, 2, HEAD_DIM, 4, dtype)
    args = (batch.k_cache, batch.v_cache)

    def attend(q, tables, lens, **kwargs):
        return paged_decode_attention(q, *args, tables, lens, batch.scale, block_n=BLOCK_N,
                                      min_tiles=1, fused_merge=fused_merge, **kwargs)

    together = attend(batch.q, batch.block_tables, batch.seq_lens)
    wide = torch.zeros(len(LENS), 4 * batch.block_tables.shape[1], dtype=batch.block_tables.dtype,
                       device=batch.block_tables.device)
    wide[:, :batch.block_tables.shape[1]] = batch.block_tables
    assert torch.equal(attend(batch.q, wide, batch.seq_lens), together)
    # a program per split, or each program taking every n-th split of its sequence
    for programs in (1, 2, 3, 64):
        assert torch.equal(attend(batch.q, wide, batch.seq_lens, split_programs=programs),
                           together), programs
    for i, n in enumerate(LENS):
        alone = attend(batch.q[i:i + 1], batch.block_tables[i:i + 1, :-(-n // 4)],
                       batch.seq_lens[i:i + 1])
        assert torch.equal(alone, together[i:i + 1]), n


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_merge_matches_the_reference_and_leaves_its_counters_at_zero(dtype,
                                                                           sliding_window):
    """The merge in stage 1's last program of each (sequence, KV head): the reference's
    output (on the interpreter, which runs the same merge code in the same order, the two-kernel
    path's bits exactly), each program count, and every arrival counter back at zero for the
    next launch. On a GPU, 20 launches of many programs each give the same bits: a merge that
    read a partial before its program stored it would differ now and then."""
    lens = LENS if not HAS_CUDA else [1, 17, 1000, 4097] * 16
    batch = make_paged_batch([(n - 1, 1) for n in lens], 8, 2, HEAD_DIM, 4, dtype)
    expected = reference.paged_decode_attention(
        batch.q.float(), batch.k_cache.float(), batch.v_cache.float(), batch.block_tables,
        batch.seq_lens, batch.scale, sliding_window=sliding_window)

    def attend(fused, programs=None):
        return paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                      batch.seq_lens, batch.scale, block_n=BLOCK_N, min_tiles=1,
                                      sliding_window=sliding_window, split_programs=programs,
                                      fused_merge=fused)

    fused = attend(True)
    torch.testing.assert_close(fused.float(), expected, atol=ATOL[dtype], rtol=0)
    assert not arrival_counters(batch.q.device, 1).any()
    for programs in (1, 2, 3):
        assert torch.equal(attend(True, programs), fused), programs
    if not HAS_CUDA:
        assert torch.equal(attend(False), fused)
    for _ in range(20 if HAS_CUDA else 0):
        assert torch.equal(attend(True), fused)


def test_arrival_counters_grow_and_keep_what_a_graph_holds():
    device = torch.device("cpu")
    decode_attention._ARRIVALS.pop(device, None)
    first = arrival_counters(device, 10)
    assert first.numel() == 16384 and first.dtype == torch.int32 and not first.any()
    assert arrival_counters(device, 16384) is first
    grown = arrival_counters(device, 20000)
    assert grown.numel() == 20000 and grown is not first
    assert any(t is first for t in decode_attention._RETIRED)
    assert arrival_counters(device, 5) is grown


def test_decode_rejects_mismatched_arguments():
    batch = make_paged_batch([(3, 1)], 4, 2, HEAD_DIM, 16)
    with pytest.raises(ValueError, match="heads"):
        paged_decode_attention(batch.q[:, :3], batch.k_cache, batch.v_cache, batch.block_tables,
                               batch.seq_lens, batch.scale)
    with pytest.raises(ValueError, match="dtypes"):
        paged_decode_attention(batch.q.half(), batch.k_cache, batch.v_cache, batch.block_tables,
                               batch.seq_lens, batch.scale)
