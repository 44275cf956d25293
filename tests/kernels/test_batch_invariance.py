"""Batch invariance of the CPU kernels: a row computed alone, among M = 3, 16 or 64 other rows,
at any position and on any thread count gives the same float32 bits (the C kernels' headers:
one order of sums per row, "Defeating Nondeterminism in LLM Inference", Thinking Machines 2025).

Checked directly, kernel by kernel: the quantized matmul for every format and every path
(the AVX-512 row kernels below 6 or 10 rows, the tiles above, the AVX2 panels, the scalar
loops, F32's rows and 4x4 blocks, the 16-row tiled layouts' row kernels), attention (its split
of long contexts into parts, decode queries against a prefill chunk's, chunk sizes), RMSNorm
and SiLU. The engine-level and
whole-stack checks are in tests/unit/test_batch_invariance.py and
tests/integration/test_determinism.py.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from kernels import cpu_attention, decode_ops, quant

from .conftest import make_paged_batch
from .test_quant_matmul import make_weight

pytestmark = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler on this machine")

OTHERS = (0, 2, 15, 63)  # rows beside the probed one: M = 1, 3, 16, 64


def with_threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def batches_around(probe: torch.Tensor, seed: int):
    """(rows, index of probe) for every M in OTHERS and the probe first, middle and last."""
    gen = torch.Generator().manual_seed(seed)
    for others in OTHERS:
        for where in sorted({0, others // 2, others}):
            rows = torch.randn(others + 1, *probe.shape, generator=gen) * 2
            rows[where] = probe
            yield rows, where


# (format, rows, columns, repacked in 16-row tiles): 37 rows are two whole tiles and a padded
# one; 960 x 576 and 576 x 1536 are the built-in model's q/k/v and down shapes, which the served
# default runs as 16-row tiles (quant.tiled16; Q4_1 and Q8_0, whole tiles only)
MATMUL_CASES = [(fmt, n, k, False) for fmt in quant.FORMATS
                for n, k in ((37, 96), (960, 576), (576, 1536))]
MATMUL_CASES += [(fmt, n, k, True) for fmt in quant.TILED for n, k in ((960, 576), (576, 1536))]


@pytest.mark.parametrize("fmt,n,k,tiled", MATMUL_CASES)
def test_matmul_row_does_not_depend_on_batch_threads_or_path(fmt, n, k, tiled):
    """The probe alone, among 3, 16 or 64 rows, first, middle or last, on 1 and 2 threads: every
    path (``quant.isas()``) gives the bits of the scalar one on the file's rows, which sums as
    the header says; tiled: the same weight in 16-row tiles (their row kernels at every
    batch) gives those bits too."""
    w = make_weight(fmt, n, k, seed=n)
    layout = quant.tiled16(w) if tiled else w
    probe = torch.randn(k, generator=torch.Generator().manual_seed(k))
    expected = quant.quant_matmul(probe[None], w, isa="scalar")[0]
    for isa in quant.isas():
        for threads in (1, 2):
            for rows, where in batches_around(probe, seed=n + k):
                out = with_threads(threads, lambda: quant.quant_matmul(rows, layout, isa=isa))
                assert torch.equal(out[where], expected), (isa, threads, rows.shape[0], where)


@pytest.mark.parametrize("fmt", quant.QUANTIZED)
def test_lm_head_rows_across_the_row_and_tile_kernels(fmt):
    """Batches of 1-12 rows cross the row kernels' and the tiles' thresholds (6 for Q4, 10 for
    Q8_0, the tied LM head's format) at the LM head's width."""
    w = make_weight(fmt, 300, 576, seed=5)
    x = torch.randn(12, 576, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([quant.quant_matmul(x[i:i + 1], w) for i in range(12)])
    for m in range(2, 13):
        assert torch.equal(quant.quant_matmul(x[:m], w), alone[:m]), m


def test_fused_parts_give_each_row_the_bits_it_has_alone():
    """q/k/v as three parts in one call (the fused forward's shape) against one part."""
    parts = [make_weight("q4_1", n, 576, seed=n) for n in (576, 192, 192)]
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(9))
    fused = quant.quant_matmul(x, parts)
    for i in range(9):
        assert torch.equal(quant.quant_matmul(x[i:i + 1], parts)[0], fused[i])


# (cached tokens, query tokens) per sequence: short contexts are one part, 700 and 2000 are
# cut into parts (split-K) whatever the batch
PROBE_LEN = (700, 1)
NEIGHBOURS = [(40, 1), (2000, 1), (15, 1), (130, 1), (0, 1), (64, 1)]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (6, 2, 8)])
def test_decode_attention_query_does_not_depend_on_batch_or_threads(num_heads, num_kv_heads,
                                                                    head_dim):
    """(9, 3, 64): the built-in model's shape, AVX-512 passes; (6, 2, 8): the plain loops. The
    probe (700 cached tokens, several parts) alone, then among 2, 15 and 63 other sequences
    (some of 2000 tokens), on 1 and 2 threads."""
    seqs = [PROBE_LEN] + NEIGHBOURS * 11
    batch = make_paged_batch(seqs, num_heads, num_kv_heads, head_dim, 16, device="cpu")

    def attend(idx):
        return cpu_attention.paged_decode_attention(
            batch.q[idx].contiguous(), batch.k_cache, batch.v_cache,
            batch.block_tables[idx].contiguous(), batch.seq_lens[idx].contiguous(), batch.scale)

    alone = with_threads(1, lambda: attend(torch.tensor([0])))[0]
    for others in OTHERS:
        for where in sorted({0, others // 2, others}):
            idx = list(range(1, others + 1))
            idx.insert(where, 0)
            for threads in (1, 2):
                out = with_threads(threads, lambda: attend(torch.tensor(idx)))
                assert torch.equal(out[where], alone), (others, where, threads)


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (6, 2, 8)])
def test_prefill_tokens_get_the_decode_steps_bits(block_size, num_heads, num_kv_heads,
                                                  head_dim):
    """A 300-token prompt (parts from its 64th token on) attended as one prefill chunk, as
    chunks of 7, as a cached prefix of 100 plus the rest, and token by token as decode steps
    (what a preempted or migrated request recomputes): the same bits for every token. Beside
    it in each call, another sequence's chunk."""
    prompt, other = 300, (50, 20)
    batch = make_paged_batch([(0, prompt), other], num_heads, num_kv_heads, head_dim,
                             block_size, device="cpu")
    q, tables, scale = batch.q[:prompt], batch.block_tables, batch.scale
    q_other = batch.q[prompt:]

    def chunked(size: int, start: int = 0) -> torch.Tensor:
        rows = []
        for a in range(start, prompt, size):
            b = min(a + size, prompt)  # this chunk: tokens a..b-1, then the other sequence's
            qs = torch.cat([q[a:b], q_other])
            out = cpu_attention.paged_prefill_attention(
                qs, batch.k_cache, batch.v_cache, tables,
                torch.tensor([b, sum(other)]), [0, b - a, b - a + other[1]], scale)
            rows.append(out[:b - a])
        return torch.cat(rows)

    decode = torch.cat([cpu_attention.paged_decode_attention(
        q[t:t + 1], batch.k_cache, batch.v_cache, tables[:1], torch.tensor([t + 1]), scale)
        for t in range(prompt)])
    assert torch.equal(chunked(prompt), decode)
    assert torch.equal(chunked(7), decode)
    assert torch.equal(chunked(200, start=100), decode[100:])
    assert torch.equal(with_threads(1, lambda: chunked(64)), decode)


def test_prefill_chunk_matches_dense_attention():
    """The C prefill path is attention (not only self-consistent): against the float64
    reference of ``tests/kernels/test_reference.py``."""
    from .test_reference import naive_batch

    batch = make_paged_batch([(0, 40), (100, 30), (0, 1), (17, 9)], 9, 3, 64, 16, device="cpu")
    out = cpu_attention.paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache,
                                                batch.block_tables, batch.seq_lens,
                                                batch.query_start_loc, batch.scale)
    torch.testing.assert_close(out.double(), naive_batch(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d", [576, 1536, 100])
def test_rmsnorm_and_silu_rows_do_not_depend_on_batch_or_threads(d):
    """d = 100: a tail of 4 after six 16-lane steps (the masked tail keeps one order)."""
    probe = torch.randn(d, generator=torch.Generator().manual_seed(d)) * 3
    weight = torch.randn(d)
    residual = torch.randn(d)

    def norm(rows, res):
        x = rows.clone()
        return decode_ops.add_rmsnorm(x, res, weight, 1e-5, torch.empty_like(rows)), x

    def silu(rows):
        gate_up = torch.cat([rows, rows.flip(-1)], dim=-1).contiguous()
        return decode_ops.silu_mul(gate_up, torch.empty_like(rows))

    (h1, x1) = norm(probe[None], residual[None])
    s1 = silu(probe[None])
    for threads in (1, 2):
        for rows, where in batches_around(probe, seed=d):
            res = torch.randn_like(rows)
            res[where] = residual
            h, x = with_threads(threads, lambda: norm(rows, res))
            assert torch.equal(h[where], h1[0]) and torch.equal(x[where], x1[0])
            assert torch.equal(with_threads(threads, lambda: silu(rows))[where], s1[0])
