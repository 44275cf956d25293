"""The quantized matmul's batch >= 6 path (``csrc/quant_matmul.c``: row-interleaved 16-row
weight tiles, ``unpack_tile`` / ``TILE_MICRO``) at decode-batch and prefill-chunk sizes.

Odd batch sizes leave 4/2/1-row remainders after the 8-row chunks; output counts that are not
multiples of 16 leave a zero-padded last tile per part. The tolerance is the method's own
(``activation_error_bound``), as in ``test_quant_matmul``; each output element's arithmetic
does not depend on which other rows or parts share the call, so those comparisons are exact.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from kernels import quant
from kernels.quant import QuantizedWeight
from tests.kernels.test_quant_matmul import check_close, make_weight

pytestmark = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler on this machine")

BATCHES = (6, 7, 9, 15, 16, 17, 23, 31, 63, 64, 65, 127, 129, 513)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("isa", ["avx512_vnni", "avx2", "scalar"])
def test_batch_6_to_513_matches_dequantized_matmul(fmt, isa):
    """37 output rows: two whole tiles and a 5-row padded one; K = 96: three blocks."""
    if isa not in quant.isas():
        pytest.skip(f"{isa} not in this build ({quant.isa()})")
    w = make_weight(fmt, 37, 96, seed=7)
    for m in BATCHES:
        x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
        check_close(x, w, isa=isa)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_prefill_chunk_of_2048_rows_at_model_width(fmt):
    w = make_weight(fmt, 80, 576, seed=3)
    x = torch.randn(2048, 576, generator=torch.Generator().manual_seed(5))
    err = check_close(x, w)
    assert err.max() > 0  # rounding happened: int8 activations (F32: float32 sums)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_a_row_does_not_depend_on_its_batch(fmt):
    """The same activation row gives the same bits in any batch of 6 or more (8-row chunks and
    their 4/2/1 remainders run the same per-lane arithmetic; F32's 1-row path below 8 rows and
    4 x 4 blocks from 8 sum a row by the same tree)."""
    w = make_weight(fmt, 50, 192, seed=11)
    x = torch.randn(129, 192, generator=torch.Generator().manual_seed(1))
    whole = quant.quant_matmul(x, w)
    for m in (6, 7, 13, 64):
        assert torch.equal(quant.quant_matmul(x[:m].contiguous(), w), whole[:m])
    assert torch.equal(quant.quant_matmul(x[120:].contiguous(), w), whole[120:])


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_parts_with_partial_tiles_equal_each_part_alone(fmt):
    """Fused parts of 37, 16 and 5 rows (two padded tiles) give each part's own product."""
    parts = [make_weight(fmt, n, 128, seed=n) for n in (37, 16, 5)]
    x = torch.randn(19, 128, generator=torch.Generator().manual_seed(2))
    fused = quant.quant_matmul(x, parts)
    alone = torch.cat([quant.quant_matmul(x, p) for p in parts], dim=1)
    assert torch.equal(fused, alone)
    whole = QuantizedWeight(torch.cat([p.data for p in parts]), fmt, 58, 128)
    check_close(x, whole)


def test_output_with_row_stride_keeps_other_columns():
    """``out`` rows wider than the product (the kernel's ldo): masked stores of the padded last
    tile must not write past the weight's rows."""
    w = make_weight("q4_0", 21, 64, seed=9)
    x = torch.randn(10, 64)
    lib = quant._library()
    out = torch.full((10, 32), 7.0)
    ptrs, rows = quant._part_arrays(((w.data.data_ptr(), 21),))
    quant._check(lib.tandem_quant_matmul_f32(x.data_ptr(), ptrs, rows, 1, out.data_ptr(), 10, 64,
                                             32, quant.FORMATS["q4_0"][0], 1, quant.isa_level()),
                 "quant_matmul")
    assert torch.equal(out[:, :21], quant.quant_matmul(x, w))
    assert (out[:, 21:] == 7.0).all()
