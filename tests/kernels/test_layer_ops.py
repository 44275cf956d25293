"""The Triton layer ops (``kernels.layer_ops``) against their torch references in
``kernels.reference`` (Hugging Face's rounding). On CPU they run in Triton's interpreter, whose
float32 -> bfloat16 conversion truncates instead of rounding: there bfloat16 results may sit one
bfloat16 unit from the reference's; float32 results sit a few float32 units apart at most."""
from __future__ import annotations

import pytest
import torch

from kernels import reference

from .conftest import DEVICE, HAS_CUDA

layer_ops = pytest.importorskip("kernels.layer_ops")

# bf16: one unit (2^-8 relative) per rounding the interpreter truncates, on ~1-sized values
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2 if not HAS_CUDA else 8e-3}


def rand(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (5, 64), (3, 100), (17, 33)])
@pytest.mark.parametrize("add", [True, False])
def test_add_rms_norm_matches_the_reference(dtype, tokens, hidden, add):
    x = rand(tokens, hidden, dtype=dtype, seed=tokens * hidden) if add else None
    residual = rand(tokens, hidden, dtype=dtype, seed=hidden, scale=3.0)
    weight = rand(hidden, dtype=dtype, seed=1)
    ref_residual = residual.clone()
    want = reference.add_rms_norm(x, ref_residual, weight, 1e-5)
    got = layer_ops.add_rms_norm(x, residual, weight, 1e-5)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    if dtype == torch.float32 or HAS_CUDA:
        assert torch.equal(residual, ref_residual)  # one rounded add, either way
    assert torch.allclose(residual.float(), ref_residual.float(), rtol=TOL[dtype], atol=TOL[dtype])
    scale = weight.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= TOL[dtype] * 4 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (3, 100)])
@pytest.mark.parametrize("add", [True, False])
def test_add_rms_norm_with_unit_offset_matches_gemmas_norm(dtype, tokens, hidden, add):
    """Gemma's (1 + w) norm, multiplied in float32 before the cast."""
    x = rand(tokens, hidden, dtype=dtype, seed=tokens * hidden) if add else None
    residual = rand(tokens, hidden, dtype=dtype, seed=hidden, scale=3.0)
    weight = rand(hidden, dtype=dtype, seed=1, scale=0.5)
    ref_residual = residual.clone()
    want = reference.add_rms_norm(x, ref_residual, weight, 1e-6, unit_offset=True)
    got = layer_ops.add_rms_norm(x, residual, weight, 1e-6, unit_offset=True)
    assert torch.allclose(residual.float(), ref_residual.float(), rtol=TOL[dtype], atol=TOL[dtype])
    scale = (1 + weight.float()).abs().max()
    assert (got.float() - want.float()).abs().max() <= TOL[dtype] * 4 * scale
    plain = reference.add_rms_norm(None, ref_residual.clone(), weight, 1e-6)
    assert (plain.float() - want.float()).abs().max() > 0.1  # the offset is not a no-op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (5, 4, 2, 6)])
def test_qk_norm_matches_the_reference(dtype, unit_offset, tokens, heads, kv_heads, head_dim):
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=tokens, scale=3.0)
    q_w = rand(head_dim, dtype=dtype, seed=2, scale=0.5)
    k_w = rand(head_dim, dtype=dtype, seed=3, scale=0.5)
    want = qkv.clone()
    reference.qk_norm(want, q_w, k_w, 1e-6, heads, kv_heads, unit_offset)
    got = qkv.clone()
    layer_ops.qk_norm(got, q_w, k_w, 1e-6, heads, kv_heads, unit_offset)
    v = slice((heads + kv_heads) * head_dim, None)
    assert torch.equal(got[:, v], qkv[:, v])  # v untouched
    assert not torch.equal(got[:, :v.start], qkv[:, :v.start])
    assert (got.float() - want.float()).abs().max() <= TOL[dtype] * 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (7, 4, 2, 32),
                                                            (3, 2, 2, 6), (4, 8, 1, 128)])
def test_rope_write_kv_matches_the_reference(dtype, tokens, heads, kv_heads, head_dim):
    from services.engine.model import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    cos, sin = rope.cos.to(DEVICE), rope.sin.to(DEVICE)
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=tokens + heads)
    g = torch.Generator().manual_seed(heads)
    positions = torch.randperm(64, generator=g)[:tokens].to(DEVICE)
    num_blocks, block_size = 5, 4
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    if tokens > 1:
        slots[0] = -1  # a token with no slot: nothing written
    slots = slots.to(DEVICE)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [torch.full(shape, 1000.0, dtype=dtype, device=DEVICE) for _ in range(4)]
    ref_qkv = qkv.clone()
    written = slots >= 0
    want_q = reference.rope_write_kv(ref_qkv[written], positions[written], cos, sin, caches[0],
                                     caches[1], slots[written], heads, kv_heads)
    got_q = layer_ops.rope_write_kv(qkv, positions, cos, sin, caches[2], caches[3], slots,
                                    heads, kv_heads)
    assert got_q.shape == (tokens, heads, head_dim) and got_q.data_ptr() == qkv.data_ptr()
    tol = TOL[dtype] * 2
    assert (got_q[written].float() - want_q.float()).abs().max() <= tol * qkv.float().abs().max()
    assert torch.allclose(caches[2].float(), caches[0].float(), atol=tol * qkv.float().abs().max())
    assert torch.equal(caches[3], caches[1])  # v: copied as is
    assert torch.equal(caches[2] == 1000, caches[0] == 1000)  # the same slots; -1 skipped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,ffn", [(1, 1536), (4, 100), (9, 7)])
def test_silu_mul_matches_the_reference(dtype, tokens, ffn):
    gate_up = rand(tokens, 2 * ffn, dtype=dtype, seed=ffn, scale=4.0)
    want = reference.silu_mul(gate_up)
    got = layer_ops.silu_mul(gate_up)
    assert got.shape == (tokens, ffn) and got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), rtol=TOL[dtype] * 2, atol=TOL[dtype] * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,ffn", [(1, 1536), (9, 7)])
def test_gelu_tanh_mul_matches_the_reference(dtype, tokens, ffn):
    gate_up = rand(tokens, 2 * ffn, dtype=dtype, seed=ffn, scale=4.0)
    want = reference.gelu_tanh_mul(gate_up)
    got = layer_ops.gelu_tanh_mul(gate_up)
    assert got.shape == (tokens, ffn) and got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), rtol=TOL[dtype] * 2, atol=TOL[dtype] * 2)
    assert not torch.allclose(got.float(), reference.silu_mul(gate_up).float(), atol=0.1)


def test_bad_shapes_are_refused():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        layer_ops.add_rms_norm(x, x, torch.ones(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="even"):
        layer_ops.silu_mul(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="heads"):
        layer_ops.qk_norm(torch.zeros(2, 20, device=DEVICE), torch.ones(8, device=DEVICE),
                          torch.ones(8, device=DEVICE), 1e-6, 1, 1)
    cache = torch.zeros(2, 4, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="heads"):
        layer_ops.rope_write_kv(torch.zeros(2, 20, device=DEVICE), torch.zeros(2, dtype=torch.int64),
                                torch.zeros(4, 8), torch.zeros(4, 8), cache, cache,
                                torch.zeros(2, dtype=torch.int64), 1, 1)
