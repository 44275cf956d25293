"""The C decode-attention kernel for CPUs (``kernels.cpu_attention``) against naive dense
float64 attention, its argument checks, its build, and the engine's CPU dispatch to it."""
from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from kernels import cpu_attention, reference
from services.engine import attention as engine_attention

from .conftest import make_paged_batch
from .test_reference import naive_batch

pytestmark = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler on this machine")

LENGTHS = [37, 2, 90, 16, 1, 64, 33, 5, 71, 17, 48, 9, 15, 32, 129]  # 1, block edges, ragged
# few (sequence, KV head) items: long contexts are cut into parts and merged (split-K); 1100 and
# 2000 make parts longer than the 64-token minimum, 65 one token past it
FEW_LONG = [2000, 1, 65, 1100]


def decode_batch(block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, lengths=LENGTHS):
    return make_paged_batch([(n - 1, 1) for n in lengths], num_heads, num_kv_heads, head_dim,
                            block_size, device="cpu")


def run(batch, **kw):
    return cpu_attention.paged_decode_attention(batch.q, batch.k_cache, batch.v_cache,
                                                batch.block_tables, batch.seq_lens, batch.scale,
                                                **kw)


def test_kernel_is_built_and_loaded():
    """With a compiler present, the C path must really be taken (no silent fallback)."""
    assert cpu_attention.available()


@pytest.mark.parametrize("block_size", [1, 4, 16])
# head_dim 8: the plain loops; the others the AVX-512 passes (where the CPU has them) for
# groups of 3, 8, 4 and 2 query heads at head_dim 64, 32, 64 and 128
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(2, 2, 8), (6, 2, 8), (9, 3, 64),
                                                             (8, 1, 32), (8, 2, 64), (4, 2, 128)])
@pytest.mark.parametrize("lengths", [LENGTHS, FEW_LONG], ids=["many", "few-long"])
def test_matches_naive_attention(block_size, num_heads, num_kv_heads, head_dim, lengths):
    batch = decode_batch(block_size, num_heads, num_kv_heads, head_dim, lengths)
    torch.testing.assert_close(run(batch).double(), naive_batch(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths", [LENGTHS, FEW_LONG], ids=["many", "few-long"])
def test_same_bits_for_any_thread_count(lengths):
    """Each (sequence, context part) is computed by one thread, and the parts (cut by the
    context and the number of sequences alone) are merged in a fixed order."""
    batch = decode_batch(lengths=lengths)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(batch)
        torch.set_num_threads(2)
        two = run(batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_writes_into_a_slice_of_out():
    batch = decode_batch()
    out = torch.full((len(LENGTHS) + 2, 9, 64), 7.0)
    result = run(batch, out=out[1:-1])
    assert result.data_ptr() == out[1:-1].data_ptr()
    torch.testing.assert_close(out[1:-1].double(), naive_batch(batch), atol=1e-5, rtol=1e-5)
    assert (out[0] == 7).all() and (out[-1] == 7).all()


def test_other_dtypes_take_the_reference():
    batch = make_paged_batch([(n - 1, 1) for n in LENGTHS], 6, 2, 8, 4, dtype=torch.bfloat16,
                             device="cpu")
    expected = reference.paged_decode_attention(batch.q, batch.k_cache, batch.v_cache,
                                                batch.block_tables, batch.seq_lens, batch.scale)
    assert torch.equal(run(batch), expected)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 2, 8), (9, 3, 64), (8, 2, 64),
                                                             (4, 2, 128)])
@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 20.0)])
def test_a_float16_cache_gives_the_float32_kernels_bits_on_its_widened_values(
        num_heads, num_kv_heads, head_dim, window, softcap):
    """float32 queries over a float16 cache (``--kv-cache-dtype float16``): each element widens
    exactly, then the float32 kernel's sums in its order, so the result is the same bits as the
    float32 kernel over the cache converted to float32: decode rows (long contexts in parts)
    and prefill chunks (head_dim 8: the plain loops; the others the AVX-512 passes)."""
    seqs = [(6, 1), (300, 1), (1999, 1), (0, 1), (5, 11), (31, 2), (0, 17)]
    batch = make_paged_batch(seqs, num_heads, num_kv_heads, head_dim, 16, device="cpu")
    nd = 4
    k16, v16 = batch.k_cache.half(), batch.v_cache.half()
    outs = []
    for k, v in ((k16, v16), (k16.float(), v16.float())):
        out = torch.empty_like(batch.q)
        cpu_attention.paged_decode_attention(batch.q[:nd], k, v, batch.block_tables[:nd],
                                             batch.seq_lens[:nd], batch.scale, out=out[:nd],
                                             sliding_window=window, softcap=softcap)
        cpu_attention.paged_prefill_attention(batch.q, k, v, batch.block_tables[nd:],
                                              batch.seq_lens[nd:], batch.query_start_loc[nd:],
                                              batch.scale, out=out, sliding_window=window,
                                              softcap=softcap)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    want = reference.paged_attention(batch.q, k16.float(), v16.float(), batch.block_tables,
                                     batch.seq_lens, batch.query_start_loc, nd, batch.scale,
                                     sliding_window=window, softcap=softcap)
    torch.testing.assert_close(outs[0], want, atol=2e-5, rtol=0)


def test_empty_batch():
    batch = decode_batch()
    out = cpu_attention.paged_decode_attention(batch.q[:0], batch.k_cache, batch.v_cache,
                                               batch.block_tables[:0], batch.seq_lens[:0],
                                               batch.scale)
    assert out.shape == (0, 9, 64)


@pytest.mark.parametrize("corrupt,message", [
    (lambda b: b.block_tables.__setitem__((3, 0), b.k_cache.shape[0]), "block table"),
    (lambda b: b.block_tables.__setitem__((3, 0), -1), "block table"),
    (lambda b: b.seq_lens.__setitem__(2, 0), "sequence length"),
    (lambda b: b.seq_lens.__setitem__(2, b.block_tables.shape[1] * 16 + 1), "sequence length"),
])
def test_bad_metadata_raises_before_reading(corrupt, message):
    batch = decode_batch()
    corrupt(batch)
    with pytest.raises(ValueError, match=message):
        run(batch)


def test_build_is_cached_and_reports_compiler_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    first = cpu_attention.build()
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert cpu_attention.build() == first and first.stat().st_mtime_ns == mtime
    with pytest.raises(RuntimeError, match="building paged_decode_attention.c failed"):
        cpu_attention.build(compiler="false")
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == [first.name]  # no debris


def test_a_changed_header_gets_a_new_build(tmp_path, monkeypatch):
    """The kernels include ``csrc/simd_sums.h``: a cached build must not outlive a change to it."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "kernel.c").write_text('#include "value.h"\nint tandem_value(void) { return VALUE; }\n')
    built = []
    for value in (1, 2):
        (src / "value.h").write_text(f"#define VALUE {value}\n")
        built.append(cpu_attention.build_shared_library(src / "kernel.c"))
        assert ctypes.CDLL(str(built[-1])).tandem_value() == value
    assert built[0] != built[1]


def test_engine_cpu_dispatch_splits_decode_and_prefill(monkeypatch):
    """Decode rows go to the C kernel, prefill chunks to the torch reference, and the result
    equals dense attention over every row."""
    calls = []
    real_decode = cpu_attention.paged_decode_attention
    real_prefill = reference.paged_prefill_attention

    def decode(q, *args, **kw):
        calls.append(("decode", q.shape[0]))
        return real_decode(q, *args, **kw)

    def prefill(q, k_cache, v_cache, tables, *args, **kw):
        calls.append(("prefill", tables.shape[0]))
        return real_prefill(q, k_cache, v_cache, tables, *args, **kw)

    monkeypatch.setattr(cpu_attention, "paged_decode_attention", decode)
    monkeypatch.setattr(reference, "paged_prefill_attention", prefill)
    batch = make_paged_batch([(6, 1), (16, 1), (0, 17), (5, 11)], 6, 2, 8, 4, device="cpu")
    meta = engine_attention.AttentionMetadata(torch.zeros(30, dtype=torch.int64),
                                              batch.block_tables, batch.seq_lens,
                                              batch.query_start_loc, num_decode_seqs=2)
    out = engine_attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, meta,
                                           batch.scale)
    assert calls == [("decode", 2), ("prefill", 2)]
    torch.testing.assert_close(out.double(), naive_batch(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window_matches_the_reference_and_reads_no_block_before_it(window):
    """Decode rows and prefill chunks, each query over its last ``window`` tokens; table
    entries wholly before every window point at a block of NaNs (a freed block's new owner)."""
    import math

    from tests.kernels.conftest import make_paged_batch

    seqs = [(6, 1), (39, 1), (0, 1), (5, 11), (31, 2), (0, 17)]
    batch = make_paged_batch(seqs, 6, 2, 32, 4, device=torch.device("cpu"))
    nd = 3
    want = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                     batch.seq_lens, batch.query_start_loc, nd, batch.scale,
                                     sliding_window=window)
    k_cache = torch.cat([batch.k_cache, torch.full_like(batch.k_cache[:1], math.nan)])
    v_cache = torch.cat([batch.v_cache, torch.full_like(batch.v_cache[:1], math.nan)])
    tables = batch.block_tables.clone()
    locs = batch.query_start_loc
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        tables[i, :max(0, seq_len - (locs[i + 1] - locs[i]) - window + 1) // 4] = len(k_cache) - 1
    out = torch.empty_like(batch.q)
    cpu_attention.paged_decode_attention(batch.q[:nd], k_cache, v_cache, tables[:nd],
                                         batch.seq_lens[:nd], batch.scale, out=out[:nd],
                                         sliding_window=window)
    cpu_attention.paged_prefill_attention(batch.q, k_cache, v_cache, tables[nd:],
                                          batch.seq_lens[nd:], locs[nd:], batch.scale, out=out,
                                          sliding_window=window)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("softcap,window", [(50.0, None), (2.0, None), (20.0, 7)])
def test_softcap_matches_the_reference(softcap, window):
    """Gemma 2's scores c * tanh(s / c) before the softmax, decode rows and prefill chunks (the
    long context split in parts); a small cap bends every score, so the cap matters."""
    from tests.kernels.conftest import make_paged_batch

    seqs = [(6, 1), (300, 1), (0, 1), (5, 11), (31, 2), (0, 17)]
    batch = make_paged_batch(seqs, 6, 2, 32, 4, device=torch.device("cpu"))
    q = batch.q * 8  # scores well beyond the smallest cap
    nd = 3
    want = reference.paged_attention(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                     batch.seq_lens, batch.query_start_loc, nd, batch.scale,
                                     sliding_window=window, softcap=softcap)
    uncapped = reference.paged_attention(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                         batch.seq_lens, batch.query_start_loc, nd, batch.scale,
                                         sliding_window=window)
    out = torch.empty_like(q)
    cpu_attention.paged_decode_attention(q[:nd], batch.k_cache, batch.v_cache,
                                         batch.block_tables[:nd], batch.seq_lens[:nd],
                                         batch.scale, out=out[:nd], sliding_window=window,
                                         softcap=softcap)
    cpu_attention.paged_prefill_attention(q, batch.k_cache, batch.v_cache,
                                          batch.block_tables[nd:], batch.seq_lens[nd:],
                                          batch.query_start_loc[nd:], batch.scale, out=out,
                                          sliding_window=window, softcap=softcap)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=0)
    assert (want - uncapped).abs().max() > 1e-2
