"""The fused decode ops (``kernels.decode_ops``) against their torch references, several shapes
including odd ones. Tolerances come from float32 rounding: the C code sums in another order and
may fuse multiply-adds, so each result may differ by a few units in the last place of its
largest term, never more."""
from __future__ import annotations

import pytest
import torch

from kernels import decode_ops, reference
from services.engine.model import RotaryEmbedding

pytestmark = pytest.mark.skipif(not decode_ops.available(), reason="no C compiler")
EPS32 = 2.0**-23  # float32 unit roundoff x 2


@pytest.mark.parametrize("m,d", [(1, 576), (3, 576), (16, 64), (5, 33), (64, 1536), (2, 7)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_matches_torch(m, d, with_residual):
    g = torch.Generator().manual_seed(m * 1000 + d)
    x = torch.randn(m, d, generator=g) * 3
    y = torch.randn(m, d, generator=g) if with_residual else None
    w = torch.randn(d, generator=g)
    ref_x, ref_h = decode_ops.add_rmsnorm_reference(x, y, w, 1e-5)
    h = torch.empty(m, d)
    decode_ops.add_rmsnorm(x, y, w, 1e-5, h)
    assert torch.equal(x, ref_x)  # the residual add is one rounding either way
    # the mean of squares sums d terms: relative error <= d * eps; the rest a few roundings
    tol = (d + 8) * EPS32 * (w.abs() * ref_x.abs() / ref_x.pow(2).mean(-1, keepdim=True).sqrt())
    assert ((h - ref_h).abs() <= tol + 1e-30).all()


@pytest.mark.parametrize("t,heads,kv_heads,head_dim", [(1, 9, 3, 64), (7, 9, 3, 64),
                                                       (3, 4, 4, 32), (5, 6, 2, 2)])
def test_rope_write_kv_matches_torch(t, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(t * 100 + heads)
    rope = RotaryEmbedding(head_dim, 512, 100000.0)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g)
    positions = torch.randperm(512, generator=g)[:t]
    num_blocks, block_size = 6, 4
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    q = torch.empty(t, heads, head_dim)
    before = qkv.clone()
    decode_ops.rope_write_kv(qkv, heads, kv_heads, positions, rope.cos, rope.sin, k_cache,
                             v_cache, slots, q)
    assert torch.equal(qkv, before)  # the projection is read, never written
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    parts = qkv.reshape(t, heads + 2 * kv_heads, head_dim)
    ref_q = reference.rotate(parts[:, :heads], cos, sin)
    ref_k = reference.rotate(parts[:, heads:heads + kv_heads], cos, sin)
    # two products and a sum: at most one rounding of each product's size apart (FMA or not)
    bound = lambda x: 2 * EPS32 * (x.abs() + x.abs().flip(-1)).amax() + 1e-30  # noqa: E731
    assert (q - ref_q).abs().max() <= bound(parts[:, :heads])
    k_rows = k_cache.reshape(-1, kv_heads, head_dim)
    assert (k_rows[slots] - ref_k).abs().max() <= bound(parts[:, heads:heads + kv_heads])
    assert torch.equal(v_cache.reshape(-1, kv_heads, head_dim)[slots], parts[:, heads + kv_heads:])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert (k_rows[untouched] == 0).all()


@pytest.mark.parametrize("bias,qk_norm", [(True, False), (False, True), (True, True)])
def test_rope_write_kv_with_bias_and_qk_norm_matches_the_module_path(bias, qk_norm):
    """Qwen2's q/k/v bias and Qwen3's per-head q/k norms, applied before the rotation, as
    ``reference.qk_norm`` and ``rope_write_kv`` do on the module path."""
    t, heads, kv_heads, head_dim = 5, 4, 2, 16
    g = torch.Generator().manual_seed(7)
    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(t, width, generator=g)
    b = torch.randn(width, generator=g) if bias else None
    q_w, k_w = (torch.randn(head_dim, generator=g), torch.randn(head_dim, generator=g))
    norms = (q_w, k_w) if qk_norm else (None, None)
    positions, slots = torch.arange(3, 3 + t), torch.tensor([9, 2, 5, 0, 7])
    k_cache, v_cache = torch.zeros(3, 4, kv_heads, head_dim), torch.zeros(3, 4, kv_heads, head_dim)
    q = torch.empty(t, heads, head_dim)
    decode_ops.rope_write_kv(qkv, heads, kv_heads, positions, rope.cos, rope.sin, k_cache,
                             v_cache, slots, q, b, *norms, norm_eps=1e-6)
    ref = qkv + b if bias else qkv.clone()
    if qk_norm:
        reference.qk_norm(ref, q_w, k_w, 1e-6, heads, kv_heads)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    ref_q = reference.rope_write_kv(ref, positions, rope.cos, rope.sin, ref_k, ref_v, slots,
                                    heads, kv_heads)
    torch.testing.assert_close(q, ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache, ref_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_cache, ref_v, atol=1e-6, rtol=1e-6)
    plain_q = torch.empty_like(q)
    decode_ops.rope_write_kv(qkv, heads, kv_heads, positions, rope.cos, rope.sin,
                             torch.zeros_like(k_cache), torch.zeros_like(v_cache), slots, plain_q)
    assert (plain_q - q).abs().max() > 0.1  # the bias / norms were applied


@pytest.mark.parametrize("bias,qk_norm", [(False, False), (True, True)])
def test_a_float16_cache_gets_the_float32_writes_rounded_once(bias, qk_norm):
    """``--kv-cache-dtype float16``: the same float32 arithmetic, each K/V value rounded to
    nearest even once as it is stored (torch's ``.half()``), q untouched by the cache's type."""
    t, heads, kv_heads, head_dim = 5, 9, 3, 64
    g = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(t, width, generator=g) * 30  # values with bits below float16's mantissa
    extras = [torch.randn(width, generator=g) if bias else None,
              *((torch.randn(head_dim, generator=g) for _ in range(2)) if qk_norm else (None, None))]
    positions, slots = torch.arange(3, 3 + t), torch.tensor([9, 2, 5, 0, 7])
    caches = {}
    for dtype in (torch.float32, torch.float16):
        k, v = (torch.zeros(3, 4, kv_heads, head_dim, dtype=dtype) for _ in range(2))
        q = torch.empty(t, heads, head_dim)
        decode_ops.rope_write_kv(qkv, heads, kv_heads, positions, rope.cos, rope.sin, k, v,
                                 slots, q, *extras, norm_eps=1e-6)
        caches[dtype] = q, k, v
    (q32, k32, v32), (q16, k16, v16) = caches[torch.float32], caches[torch.float16]
    assert torch.equal(q16, q32)
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half())
    assert not torch.equal(k16.float(), k32)  # the rounding happened


def test_rope_write_kv_rejects_bad_positions_and_slots_before_writing():
    rope = RotaryEmbedding(8, 16, 10000.0)
    qkv, q = torch.randn(2, 3 * 8), torch.empty(2, 1, 8)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="positions"):
        decode_ops.rope_write_kv(qkv, 1, 1, torch.tensor([0, 16]), rope.cos, rope.sin,
                                 k_cache, v_cache, torch.tensor([0, 1]), q)
    with pytest.raises(ValueError, match="slot_mapping"):
        decode_ops.rope_write_kv(qkv, 1, 1, torch.tensor([0, 1]), rope.cos, rope.sin,
                                 k_cache, v_cache, torch.tensor([0, 8]), q)
    assert (k_cache == 0).all() and (v_cache == 0).all()


@pytest.mark.parametrize("m,f", [(1, 1536), (4, 1536), (3, 17), (64, 100), (1, 1)])
def test_silu_mul_matches_torch(m, f):
    g = torch.Generator().manual_seed(m + f)
    gate_up = torch.randn(m, 2 * f, generator=g) * 4
    gate_up[0, 0] = -100.0  # exp overflow side: silu -> -0
    out = torch.empty(m, f)
    decode_ops.silu_mul(gate_up, out)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    # exp and the division each round (and libm/SLEEF exp differ by a few ulp): relative 8 eps
    assert ((out - ref).abs() <= 8 * EPS32 * ref.abs() + 1e-30).all()


@pytest.mark.parametrize("m,f", [(1, 1536), (4, 1536), (3, 17), (64, 100), (1, 1)])
def test_gelu_tanh_mul_matches_torch(m, f):
    """Gemma's GeGLU against torch's gelu(approximate="tanh"), in float64 for the reference: the
    tanh through exp loses nothing that shows past 1e-6 of the result's scale."""
    g = torch.Generator().manual_seed(m + f)
    gate_up = torch.randn(m, 2 * f, generator=g) * 4
    gate_up[0, 0] = -100.0  # tanh -> -1: gelu -> -0
    out = torch.empty(m, f)
    decode_ops.gelu_tanh_mul(gate_up, out)
    gate, up = gate_up.double().chunk(2, dim=-1)
    ref = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert ((out.double() - ref).abs() <= 1e-6 * (gate.abs() * up.abs()) + 1e-30).all()
    assert torch.equal(out[:1], decode_ops.gelu_tanh_mul(gate_up[:1].clone(), torch.empty(1, f)))


@pytest.mark.parametrize("m,n,cap", [(1, 49152, 30.0), (8, 100, 30.0), (3, 17, 2.0)])
def test_softcap_matches_torch(m, n, cap):
    """Gemma 2's final logits, in place: cap * tanh(x / cap) against torch in float64."""
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(n)) * 40
    want = torch.tanh(x.double() / cap) * cap
    got = decode_ops.softcap_(x.clone(), cap)
    assert ((got.double() - want).abs() <= 1e-6 * cap).all()
    assert torch.equal(got[-1:], decode_ops.softcap_(x[-1:].clone(), cap))  # a row alone
    with pytest.raises(ValueError, match="softcap"):
        decode_ops.softcap_(x.clone(), 0.0)


def test_bad_tensors_are_rejected():
    with pytest.raises(ValueError, match="gate_up"):
        decode_ops.silu_mul(torch.randn(2, 6), torch.empty(2, 4))
    with pytest.raises(ValueError, match="float32"):
        decode_ops.add_rmsnorm(torch.randn(2, 4, dtype=torch.float64), None, torch.ones(4),
                               1e-5, torch.empty(2, 4))


@pytest.mark.parametrize("m", [1, 3, 7, 16])
def test_prepared_matmul_equals_quant_matmul(m):
    from kernels import quant
    from kernels.quant_prepared import PreparedMatmul

    if not quant.available():
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(m)
    parts = [quant.QuantizedWeight(torch.randint(0, 256, (n, 96 // 32 * 20), dtype=torch.uint8,
                                                 generator=g), "q4_1", n, 96) for n in (40, 9)]
    for p in parts:  # finite fp16 scales: byte 1 and 3 of each block below 0x7c
        blocks = p.data.view(p.out_features, 3, 20)
        blocks[..., 1] %= 0x3c
        blocks[..., 3] %= 0x3c
    x = torch.randn(m, 96, generator=g)
    prepared = PreparedMatmul(parts)
    out = torch.empty(m, prepared.out_features)
    assert torch.equal(prepared(x, out, torch.get_num_threads()), quant.quant_matmul(x, parts))


@pytest.mark.parametrize("m,n", [(1, 49152), (7, 1000), (3, 17), (64, 33), (2, 1)])
def test_argmax_rows_matches_torch_with_ties_nans_and_infinities(m, n):
    g = torch.Generator().manual_seed(m * n)
    x = torch.randn(m, n, generator=g)
    x[0, n // 2] = x[0, n - 1] = 50.0  # a tie: the first index wins
    if m > 2:
        x[1, n // 3] = float("nan")  # NaN counts as the largest
        x[1, n - 1] = float("nan")
        x[2] = float("-inf")
        x[2, n - 1] = float("inf")
    assert torch.equal(decode_ops.argmax_rows(x), x.argmax(dim=-1))
