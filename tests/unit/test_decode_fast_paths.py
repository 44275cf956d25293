"""The decode step's shortcut gives what the general code gives: ``QuantizedForward`` (the
quantized model's fused C forward) agrees with the module path, including on mixed prefill +
decode batches."""
from __future__ import annotations

import functools

import pytest
import torch

from services.engine.attention import AttentionMetadata


@functools.cache
def tiny_quantized_model():
    """A 2-layer random Llama with Q4_1 linears (GQA 4:2, head_dim 16, odd-sized FFN of 96)."""
    from services.engine.config import ModelConfig
    from services.engine.model import LlamaForCausalLM
    from services.engine.quantized import assemble_quantized
    from services.engine.quantized_loader import quantize_state_dict

    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=256,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    dense = hf_named(LlamaForCausalLM(cfg).state_dict(), cfg)
    return assemble_quantized(*quantize_state_dict(cfg, dense, "q4_1"), torch.float32)


def hf_named(state_dict: dict, cfg) -> dict:
    """Our fused q/k/v and gate/up weights under Hugging Face's separate names."""
    out = {}
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for name, t in state_dict.items():
        if name.endswith("qkv_proj.weight"):
            for part, rows in zip("qkv", t.split([q, kv, kv])):
                out[name.replace("qkv_proj", f"{part}_proj")] = rows
        elif name.endswith("gate_up_proj.weight"):
            gate, up = t.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = t
    return out


def _step(model, fused: bool, ids, positions, kv, meta):
    saved = model.fused_forward
    model.fused_forward = saved if fused else None
    try:
        with torch.inference_mode():
            return model(torch.tensor(ids), torch.tensor(positions), kv, meta)
    finally:
        model.fused_forward = saved


def test_fused_forward_agrees_with_the_module_path_on_prefill_mixed_and_decode_steps():
    from kernels import decode_ops

    model = tiny_quantized_model()
    if model.fused_forward is None:
        pytest.skip("C kernels not built: the module path is the only path")
    assert decode_ops.available()
    bs, meta = 4, AttentionMetadata
    # A: 7 prompt tokens in blocks [3, 5]; B: 5 in [0, 1]; then A decodes while C (blocks
    # [6]) prefills 4 tokens; then A, B, C decode together
    steps = [
        ([9, 8, 7, 6, 5, 4, 3, 10, 11, 12, 13, 14], list(range(7)) + list(range(5)),
         meta(torch.tensor([12, 13, 14, 15, 20, 21, 22, 0, 1, 2, 3, 4]),
              torch.tensor([[3, 5], [0, 1]]), torch.tensor([7, 5]), [0, 7, 12], 0)),
        ([20, 30, 31, 32, 33], [7, 0, 1, 2, 3],
         meta(torch.tensor([23, 24, 25, 26, 27]), torch.tensor([[3, 5], [6, 0]]),
              torch.tensor([8, 4]), [0, 1, 5], 1)),
        ([40, 41, 42], [8, 5, 4],
         meta(torch.tensor([48, 5, 28]), torch.tensor([[3, 5, 12], [0, 1, 0], [6, 7, 0]]),
              torch.tensor([9, 6, 5]), [0, 1, 2, 3], 3)),
    ]
    kv_shape = (2, 2, 16, bs, 2, 16)
    kv_module, kv_fused = torch.zeros(kv_shape), torch.zeros(kv_shape)
    for ids, positions, m in steps:
        ref = _step(model, False, ids, positions, kv_module, m)
        got = _step(model, True, ids, positions, kv_fused, m)
        # NOTE: not bit-exact: sums run in another order, and a last-bit difference can flip
        # an activation's int8 rounding in the next matmul (at most max|x_block| / 254 each);
        # a wrong rotation, residual or cache slot errs by O(1) of the values instead
        assert (got - ref).abs().max() <= 0.02 * ref.abs().max()
        assert (kv_fused - kv_module).abs().max() <= 0.02 * kv_module.abs().max()
        assert torch.equal(kv_fused == 0, kv_module == 0)  # the same slots written


def test_fused_forward_rejects_a_position_outside_the_rotary_tables():
    model = tiny_quantized_model()
    if model.fused_forward is None:
        pytest.skip("C kernels not built")
    kv = torch.zeros(2, 2, 4, 4, 2, 16)
    m = AttentionMetadata(torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]), [0, 1], 1)
    with pytest.raises(ValueError, match="positions"):
        _step(model, True, [3], [256], kv, m)
    assert not kv.any()
