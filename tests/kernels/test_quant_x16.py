"""Q4_1 and Q8_0 repacked in 16-row tiles (``kernels.quant.tiled16``, ``q4_1x16`` and
``q8_0x16``): the same weight, so every kernel path must give the same bits as on the file's
rows, at decode batches (the tiled GEMV; Q8_0X16 runs the tiled path at every batch), prefill
chunks (``unpack_tile``) and on the AVX2 and scalar paths (which read the tiles back as rows);
dequantized rows, block scales and row selections are the file format's."""
from __future__ import annotations

import shutil

import pytest
import torch

from kernels import quant
from tests.kernels.test_quant_matmul import check_close, make_weight

pytestmark = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler on this machine")

BATCHES = (1, 2, 3, 4, 5, 6, 7, 9, 16, 17, 64)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_tiles_round_trip_and_keep_their_size(fmt):
    w = make_weight(fmt, 48, 96, seed=1)
    t = quant.tiled16(w)
    assert t.fmt == fmt + "x16" and t.nbytes == w.nbytes
    assert not torch.equal(t.data, w.data)  # rearranged
    assert torch.equal(quant.untiled16(t).data, w.data)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("isa", ["avx512_vnni", "avx2", "scalar"])
def test_every_path_gives_the_file_format_bits(isa, fmt):
    """Two parts (fused q/k/v style: 48 + 16 rows), K = 576 (18 blocks): each batch's output
    equals the file-format weight's bit for bit, and lies within the method's error bound."""
    if isa not in quant.isas():
        pytest.skip(f"{isa} not in this build ({quant.isa()})")
    parts = [make_weight(fmt, 48, 576, seed=2), make_weight(fmt, 16, 576, seed=3)]
    tiled = [quant.tiled16(p) for p in parts]
    for m in BATCHES:
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        want = quant.quant_matmul(x, parts, isa=isa)
        assert torch.equal(quant.quant_matmul(x, tiled, isa=isa), want), m
        assert torch.equal(want, quant.quant_matmul(x, parts, isa="scalar")), m
    check_close(torch.randn(3, 576), tiled[0], isa=isa)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_dequantized_rows_scales_and_selections_are_the_file_format_ones(fmt):
    w = make_weight(fmt, 64, 96, seed=4)
    t = quant.tiled16(w)
    ids = torch.tensor([0, 15, 16, 63, 37])
    assert torch.equal(quant.dequantize_rows(t, ids), quant.dequantize_rows(w, ids))
    assert all(torch.equal(a, b) for a, b in zip(quant.block_scales(t), quant.block_scales(w)))
    picked = t.rows(torch.tensor([5, 2, 40]))
    assert picked.fmt == fmt and torch.equal(picked.data, w.rows(torch.tensor([5, 2, 40])).data)


def test_only_q4_1_and_q8_0_with_whole_tiles_are_repacked():
    with pytest.raises(ValueError, match="multiple of 16"):
        quant.tiled16(make_weight("q4_1", 40, 96))
    with pytest.raises(ValueError, match="q4_1 or q8_0"):
        quant.tiled16(make_weight("q4_0", 32, 96))
    for fmt in ("q4_1", "q8_0"):
        t = quant.tiled16(make_weight(fmt, 32, 96))
        with pytest.raises(ValueError, match="out_features"):
            quant.QuantizedWeight(t.data[:24], t.fmt, 24, 96)
    mixed = [make_weight("q4_1", 32, 96), make_weight("q4_1", 40, 96)]
    assert [p.fmt for p in quant.decode_layout(mixed)] == ["q4_1", "q4_1"]  # all or none
    whole = quant.decode_layout([make_weight("q4_1", 32, 96), make_weight("q4_1", 16, 96)])
    want = "q4_1x16" if quant.isa() == "avx512_vnni" else "q4_1"
    assert [p.fmt for p in whole] == [want, want]
    head = quant.decode_layout([make_weight("q8_0", 48, 96)])
    assert [p.fmt for p in head] == ["q8_0x16" if quant.isa() == "avx512_vnni" else "q8_0"]
    assert [p.fmt for p in quant.decode_layout([make_weight("q8_0", 32, 96),
                                                make_weight("q4_1", 32, 96)])] == ["q8_0", "q4_1"]
