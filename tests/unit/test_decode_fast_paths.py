"""The decode step's shortcuts give what the general code gives: ``ModelRunner``'s decode-only
inputs equal ``prepare_inputs``' general tensors, the all-plain-greedy sampling shortcut equals
``sample``, and ``QuantizedForward`` (the quantized model's fused C forward) agrees with the
module path, including on mixed prefill + decode batches."""
from __future__ import annotations

import functools
import random

import pytest
import torch

from services.engine.attention import AttentionMetadata
from services.engine.model_runner import ModelRunner
from services.engine.request import Request
from services.engine.sampler import SamplingMetadata, plain_greedy, sample
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import SchedulerOutput


def decode_batch(n: int, block_size: int, seed: int) -> SchedulerOutput:
    rng = random.Random(seed)
    out = SchedulerOutput()
    for i in range(n):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 40))]
        r = Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=64))
        r.output_token_ids = [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 30))]
        r.num_computed_tokens = r.num_tokens - 1
        r.block_table = rng.sample(range(500), -(-r.num_tokens // block_size))
        out.scheduled.append(r)
        out.num_scheduled_tokens[r.request_id] = 1
    return out


@pytest.mark.parametrize("n,block_size", [(1, 16), (5, 4), (64, 16), (3, 1)])
def test_decode_inputs_equal_the_general_path(n, block_size):
    runner = ModelRunner(model=None, kv_cache=torch.empty(0), block_size=block_size)
    out = decode_batch(n, block_size, seed=n)
    fast = runner.prepare_inputs(out)
    # the general code runs when one request computes more than one token: add a prompt
    # chunk (it sorts after the decode rows) and compare the decode rows
    extra = Request("extra", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
    extra.block_table = [499] * -(-3 // block_size)
    general = runner.prepare_inputs(SchedulerOutput(out.scheduled + [extra],
                                                    {**out.num_scheduled_tokens, "extra": 3}))
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(fast, name), getattr(general, name)[:n]), name
    assert fast.order == general.order[:n] and fast.sampled_rows == general.sampled_rows[:n]
    g = general.attn
    assert torch.equal(fast.attn.slot_mapping, g.slot_mapping[:n])
    assert torch.equal(fast.attn.seq_lens, g.seq_lens[:n])
    width = fast.attn.block_tables.shape[1]
    assert torch.equal(fast.attn.block_tables, g.block_tables[:n, :width])
    assert not g.block_tables[:n, width:].any()  # only padding beyond the decode rows' width
    assert fast.attn.query_start_loc == g.query_start_loc[:n + 1]
    assert fast.attn.num_decode_seqs == g.num_decode_seqs == n


def test_plain_greedy_shortcut_equals_sample():
    out = decode_batch(6, 16, seed=7)
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    assert all(plain_greedy(r) for r in out.scheduled)
    ref = sample(logits, SamplingMetadata.from_requests(out.scheduled, {}))
    assert torch.equal(ref.token_ids, logits.argmax(dim=-1))
    r = out.scheduled[0]
    for params in (SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.7),
                   SamplingParams(temperature=0, presence_penalty=0.5),
                   SamplingParams(temperature=0, min_tokens=100, max_tokens=200)):
        r.sampling_params = params
        assert not plain_greedy(r), params


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
    dense = LlamaForCausalLM(cfg).state_dict()
    return assemble_quantized(*quantize_state_dict(cfg, dense, "q4_1"), torch.float32)


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
