"""The quantized-weight matmul (``kernels.quant``, C kernel ``csrc/quant_matmul.c``) against
dequantize-then-matmul in float64, over a grid of shapes and block-format edge cases.

Weights are quantized with gguf-py's reference quantizers (llama.cpp's algorithms), so the
blocks are what a GGUF file holds. The tolerance is ``activation_error_bound``: the int8
rounding of each activation block plus float32 accumulation (F32 weights: the accumulation
alone), derived in its docstring.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from kernels import quant
from kernels.quant import QuantizedWeight

pytestmark = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler on this machine")


def make_weight(fmt: str, n: int, k: int, seed: int = 0, scale: float = 0.05) -> QuantizedWeight:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
    data = quantize(w, GGMLQuantizationType[fmt.upper()]).view(np.uint8)  # F32: its bytes
    return QuantizedWeight(torch.from_numpy(data), fmt, n, k)


def check_close(x: torch.Tensor, w: QuantizedWeight, isa: str | None = None) -> torch.Tensor:
    y = quant.quant_matmul(x, w, isa=isa)
    ref = (x.double() @ quant.dequantize(w).double().T).float()
    bound = quant.activation_error_bound(x, w)
    err = (y - ref).abs()
    assert torch.isfinite(y).all()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    return err


def test_kernel_is_built_and_loaded():
    assert quant.available()
    assert quant.isa() in ("avx512_vnni", "avx2", "scalar")


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_dequantize_equals_gguf(fmt):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = make_weight(fmt, 37, 96)
    expected = dequantize(w.data.numpy(), GGMLQuantizationType[fmt.upper()])
    assert torch.equal(quant.dequantize(w), torch.from_numpy(expected))
    ids = torch.tensor([36, 0, 5, 5])
    assert torch.equal(quant.dequantize_rows(w, ids), torch.from_numpy(expected)[ids])


@pytest.mark.parametrize("fmt", quant.QUANTIZED)
@pytest.mark.parametrize("n,k", [(1, 32), (37, 96), (64, 576), (576, 1536), (1536, 576), (17, 64)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 17, 64])
def test_matches_dequantized_matmul(fmt, n, k, m):
    w = make_weight(fmt, n, k, seed=n * k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    err = check_close(x, w)
    # the bound must be informative: far below the size of the products it bounds
    scale = x.abs() @ quant.dequantize(w).abs().T
    assert (quant.activation_error_bound(x, w) <= 0.05 * scale + 1e-6).all()
    assert err.max() > 0  # activations really were quantized (a float path would be exact)


@pytest.mark.parametrize("n,k", [(1, 32), (37, 96), (576, 1536), (1536, 576), (17, 64)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 9, 16, 17, 65, 130])
def test_f32_rows_match_float64_matmul(n, k, m):
    """F32 weights (plain float rows, not quantized): the row kernel at batch 1-2; from 3,
    16-row activation panels (zero padded: 3, 17) against weight tiles of 16, 8, 4 and 1 rows
    (37 = 16 + 16 + 4 + 1), in chunks of 64 activation rows (65, 130 cross them). Only the
    float32 sums' rounding differs from float64, far inside the bound."""
    w = make_weight("f32", n, k, seed=n * k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    check_close(x, w)
    assert torch.equal(quant.dequantize(w).view(torch.uint8), w.data)  # the rows, as stored
    scale = x.abs() @ quant.dequantize(w).abs().T
    assert (quant.activation_error_bound(x, w) <= 1e-4 * scale + 1e-12).all()


def test_f32_weights_have_no_block_scales():
    with pytest.raises(ValueError, match="fmt"):
        quant.block_scales(make_weight("f32", 4, 32))


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("isa", quant.ISAS)
@pytest.mark.parametrize("n,k", [(17, 64), (37, 96), (100, 576)])
def test_every_path_matches_dequantized_matmul(fmt, isa, n, k):
    """Each dot-product path of the build (the AVX2 and scalar ones too, forced, as on a CI
    machine without AVX-512) at every tile shape: direct kernels on the file's blocks (batch
    1: 4 weight rows at a time plus 1-3 left; batch 2-5: 2-5 activation rows), a padded 16-row
    panel plus row kernels (6-17: 17 = one panel + one row; AVX2 panels for Q4), two-panel
    tiles (33, 64), and output counts that leave partial 16-row tiles and 8/4/1-row
    remainders."""
    if isa not in quant.isas():
        pytest.skip(f"{isa} not in this build ({quant.isa()})")
    w = make_weight(fmt, n, k, seed=n + k)
    for m in (1, 2, 3, 4, 5, 6, 15, 16, 17, 22, 33, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        check_close(x, w, isa=isa)


def test_unknown_path_is_rejected():
    w = make_weight("q4_0", 16, 64)
    with pytest.raises(ValueError, match="isa"):
        quant.quant_matmul(torch.zeros(2, 64), w, isa="avx1024")


def test_outlier_activations_stay_within_bound():
    """One huge activation per block (the residual stream's massive activations) coarsens that
    block's int8 grid; the bound follows it."""
    w = make_weight("q4_1", 64, 256)
    x = torch.randn(8, 256)
    x[:, ::32] = 3000.0
    check_close(x, w)


def test_parts_equal_concatenated_weight():
    parts = [make_weight("q4_1", n, 576, seed=n) for n in (576, 192, 192)]
    whole = QuantizedWeight(torch.cat([p.data for p in parts]), "q4_1", 960, 576)
    x = torch.randn(5, 576)
    assert torch.equal(quant.quant_matmul(x, parts), quant.quant_matmul(x, whole))


@pytest.mark.parametrize("fmt,rows,batch", [("q8_0", 300, 7), ("q4_1", 1000, 64),
                                            ("f32", 1000, 1), ("f32", 300, 70)])
def test_thread_count_does_not_change_results(fmt, rows, batch):
    """Threads split the weight tiles (batch 7: row kernels; 64: 16-row panels)."""
    w, x = make_weight(fmt, rows, 576, seed=4), torch.randn(batch, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant.quant_matmul(x, w)
        torch.set_num_threads(2)
        two = quant.quant_matmul(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_all_zero_blocks_and_zero_activations_give_exact_zeros(fmt):
    n, k = 20, 64
    zero = QuantizedWeight(torch.zeros(n, k // 32 * quant.FORMATS[fmt][1], dtype=torch.uint8),
                           fmt, n, k)
    assert torch.equal(quant.quant_matmul(torch.randn(3, k), zero), torch.zeros(3, n))
    w = make_weight(fmt, n, k)
    assert torch.equal(quant.quant_matmul(torch.zeros(3, k), w), torch.zeros(3, n))


@pytest.mark.parametrize("fmt", quant.QUANTIZED)
@pytest.mark.parametrize("d", [65504.0, 6e-8, -1.0])  # fp16 max, smallest subnormal, negative
def test_extreme_scales(fmt, d):
    w = make_weight(fmt, 16, 64)
    raw = w.data.reshape(16, 2, quant.FORMATS[fmt][1]).clone()
    raw[..., 0:2] = torch.tensor([d], dtype=torch.float16).view(torch.uint8)
    w = QuantizedWeight(raw.reshape(16, -1), fmt, 16, 64)
    x = torch.randn(4, 64) * (1e-3 if d > 1 else 1.0)
    check_close(x, w)


def test_bad_shapes_are_rejected_with_the_field_named():
    data = torch.zeros(4, 2 * 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="in_features"):
        QuantizedWeight(torch.zeros(4, 20, dtype=torch.uint8), "q4_1", 4, 48)
    with pytest.raises(ValueError, match="data"):
        QuantizedWeight(data[:, :30], "q4_1", 4, 64)
    with pytest.raises(ValueError, match="fmt"):
        QuantizedWeight(data, "q5_k", 4, 64)
    w = QuantizedWeight(data, "q4_1", 4, 64)
    with pytest.raises(ValueError, match="x"):
        quant.quant_matmul(torch.zeros(2, 63), w)
    with pytest.raises(ValueError, match="ids"):
        quant.dequantize_rows(w, torch.tensor([4]))
    with pytest.raises(ValueError, match="weight"):
        quant.quant_matmul(torch.zeros(2, 64), [w, make_weight("q8_0", 4, 64)])


def test_other_activation_dtypes_come_back_in_their_dtype():
    w = make_weight("q4_0", 32, 64)
    x = torch.randn(3, 64).to(torch.bfloat16)
    y = quant.quant_matmul(x, w)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, quant.quant_matmul(x.float(), w).to(torch.bfloat16))


def test_default_path_can_be_set_for_benchmarks():
    """``set_default_isa`` picks the path ``quant_matmul`` and ``PreparedMatmul`` pass to the
    kernel when not told (the paths give the same bits, so the argument is what shows)."""
    w = make_weight("q4_1", 40, 96)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(3))
    try:
        quant.set_default_isa("scalar")
        assert quant.isa_level() == quant.ISAS.index("scalar")
        assert torch.equal(quant.quant_matmul(x, w), quant.quant_matmul(x, w, isa="scalar"))
        with pytest.raises(ValueError, match="isa"):
            quant.set_default_isa("avx1024")
    finally:
        quant.set_default_isa(None)
    assert quant.isa_level() == quant.ISAS.index(quant.isa())


def _cpu_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1] for line in text.splitlines()
                     if line.startswith("flags")),
                    "").split())


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_builds_for_other_machines_match_reference(march, tmp_path, monkeypatch):
    """The source built as an AVX2-only machine (haswell) or a plain x86-64 one builds it: every
    path that build has agrees with the reference (a path compiled only with AVX-512 must not
    leave the others broken)."""
    import ctypes
    import subprocess

    from kernels.cpu_attention import CFLAGS, LDFLAGS

    if march == "haswell" and not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("this CPU cannot run an AVX2 build")
    cc = shutil.which("cc") or shutil.which("gcc")
    flags = [f if not f.startswith("-march=") else f"-march={march}" for f in CFLAGS]
    obj, lib_path = tmp_path / "k.o", tmp_path / "k.so"
    for cmd in ([cc, *flags, "-c", str(quant.SOURCE), "-o", str(obj)],
                [cc, *LDFLAGS, str(obj), "-o", str(lib_path), "-lm"]):
        subprocess.run(cmd, check=True, capture_output=True)
    lib = ctypes.CDLL(str(lib_path))
    lib.tandem_quant_matmul_f32.argtypes = ([quant._PTR] * 3 + [quant._INT, quant._PTR]
                                            + [quant._I64] * 3 + [quant._INT] * 3)
    lib.tandem_quant_dequantize_rows.argtypes = [quant._PTR] * 3 + [quant._I64] * 3 + [quant._INT]
    monkeypatch.setattr(quant, "_library", lambda: lib)
    assert quant.isa() == ("avx2" if march == "haswell" else "scalar")
    for fmt in quant.FORMATS:
        w = make_weight(fmt, 37, 96)
        for m in (1, 5, 17, 33):
            x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
            for isa in quant.isas():
                check_close(x, w, isa=isa)
