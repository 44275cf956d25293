"""The torch references themselves, against naive dense attention; and the engine's dispatch.

Runs without triton: this is the CPU engine's attention path.
"""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from services.engine import attention as engine_attention

from .conftest import make_paged_batch

MIXED = [(6, 1), (16, 1), (0, 1), (0, 17), (5, 11), (16, 16), (31, 2)]  # decodes first


def naive_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Dense float64 attention of ``q`` ``[n, H, D]``, the last n of ``k``/``v``'s positions
    (``[seq_len, Hkv, D]``), with an explicit causal mask and an explicit GQA head map."""
    n, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    kv_head = torch.arange(num_heads) // (num_heads // num_kv_heads)
    k, v = k.double()[:, kv_head], v.double()[:, kv_head]  # [seq_len, H, D]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(seq_len - n, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def naive_batch(batch) -> torch.Tensor:
    out = []
    for i, (start, end) in enumerate(zip(batch.query_start_loc, batch.query_start_loc[1:])):
        out.append(naive_causal_attention(batch.q[start:end], batch.keys[i], batch.values[i],
                                          batch.scale))
    return torch.cat(out)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 2)])
def test_reference_paged_attention_matches_naive(block_size, num_heads, num_kv_heads):
    batch = make_paged_batch(MIXED, num_heads, num_kv_heads, 8, block_size, device="cpu")
    out = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                    batch.seq_lens, batch.query_start_loc, 2, batch.scale)
    torch.testing.assert_close(out.double(), naive_batch(batch), atol=1e-5, rtol=1e-5)


def test_reference_decode_and_prefill_agree_on_single_tokens():
    batch = make_paged_batch([(3, 1), (16, 1), (40, 1)], 6, 2, 8, 16, device="cpu")
    decode = reference.paged_decode_attention(batch.q, batch.k_cache, batch.v_cache,
                                              batch.block_tables, batch.seq_lens, batch.scale)
    prefill = reference.paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache,
                                                batch.block_tables, batch.seq_lens,
                                                batch.query_start_loc, batch.scale)
    torch.testing.assert_close(decode, prefill, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bucket_size", [1, 3, 8, 64])
def test_reference_decode_buckets_match_naive(bucket_size):
    """Unsorted, varied lengths across several length buckets: every row lands in its place."""
    lengths = [37, 2, 90, 16, 1, 64, 33, 5, 71, 17, 48, 9]
    batch = make_paged_batch([(n - 1, 1) for n in lengths], 6, 2, 8, 4, device="cpu")
    out = reference.paged_decode_attention(batch.q, batch.k_cache, batch.v_cache,
                                           batch.block_tables, batch.seq_lens, batch.scale,
                                           bucket_size=bucket_size)
    torch.testing.assert_close(out.double(), naive_batch(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lead", [(), (3, 2)])
def test_reference_gather_scatter_blocks_round_trip(lead):
    cache = torch.randn(*lead, 10, 4, 2, 8)
    ids = torch.tensor([7, 0, 3])
    buffer = reference.gather_blocks(cache, ids)
    assert buffer.shape == (*lead, 3, 4, 2, 8) and buffer.is_contiguous()
    for i, b in enumerate(ids.tolist()):
        assert torch.equal(buffer[..., i, :, :, :], cache[..., b, :, :, :])
    target = torch.zeros_like(cache)
    reference.scatter_blocks(buffer, target, ids)
    assert torch.equal(target.index_select(-4, ids), buffer)
    untouched = [b for b in range(10) if b not in ids.tolist()]
    assert not target.index_select(-4, torch.tensor(untouched)).any()


def test_engine_dispatch_uses_reference_on_cpu(monkeypatch):
    calls = []

    def fail():
        raise AssertionError("the Triton path was taken for CPU tensors")

    def spy(name):
        real = getattr(reference, name)

        def wrapper(*args, **kw):
            calls.append(name)
            return real(*args, **kw)
        return wrapper

    batch = make_paged_batch([(4, 1), (0, 5)], 4, 2, 8, 4, device="cpu")
    monkeypatch.setattr(engine_attention, "_triton_attention", fail)
    monkeypatch.setattr(engine_attention, "_cache_ops", fail)
    for name in ("paged_prefill_attention", "write_kv_cache"):
        monkeypatch.setattr(reference, name, spy(name))
    k = torch.randn(6, 2, 8)
    slots = torch.arange(6)
    engine_attention.write_kv_cache(k, k, batch.k_cache, batch.v_cache, slots)
    meta = engine_attention.AttentionMetadata(slots, batch.block_tables, batch.seq_lens,
                                              batch.query_start_loc, num_decode_seqs=1)
    out = engine_attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, meta,
                                           batch.scale)
    assert calls == ["write_kv_cache", "paged_prefill_attention"]  # decode: test_cpu_attention
    assert out.shape == batch.q.shape


def test_attention_metadata_derived_fields():
    meta = engine_attention.AttentionMetadata(torch.zeros(9, dtype=torch.int64),
                                              torch.zeros(3, 2, dtype=torch.int64),
                                              torch.tensor([5, 7, 9]), [0, 1, 2, 9], 2)
    assert meta.max_query_len == 7
    t = meta.query_start_loc_tensor(torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [0, 1, 2, 9]
    assert meta.query_start_loc_tensor(torch.device("cpu")) is t  # built once per step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_dispatch_uses_triton_on_cuda(monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed")
    calls = []
    real = engine_attention._triton_attention()
    monkeypatch.setattr(reference, "paged_attention",
                        lambda *a: (_ for _ in ()).throw(AssertionError("reference on CUDA")))
    monkeypatch.setattr(real, "paged_attention", lambda *a, **kw: calls.append(a) or a[0])
    batch = make_paged_batch([(4, 1), (0, 5)], 4, 2, 64, 16, device="cuda")
    meta = engine_attention.AttentionMetadata(torch.zeros(6, dtype=torch.int64, device="cuda"),
                                              batch.block_tables, batch.seq_lens,
                                              batch.query_start_loc, num_decode_seqs=1)
    engine_attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, meta, batch.scale)
    assert len(calls) == 1 and calls[0][5].is_cuda
