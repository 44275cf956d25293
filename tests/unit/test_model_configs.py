"""config.json dialects and RoPE variants of the supported architectures: what older
transformers versions wrote (rope_theta beside rope_scaling, Gemma 3's rope_local_base_freq and
sliding_window_pattern, Phi-3's "su"), and every RoPE variant's inverse frequencies bit for bit
against transformers' own ``ROPE_INIT_FUNCTIONS``."""
from __future__ import annotations

import pytest
import torch

from services.engine.config import FULL_ATTENTION as FULL
from services.engine.config import SLIDING_ATTENTION as SLIDING
from services.engine.config import ModelConfig
from services.engine.loader import hf_config
from services.engine.rotary import RotaryEmbedding, inv_freq

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def config(**raw) -> ModelConfig:
    return hf_config({**BASE, **raw})[1]


def test_gemma3_older_config_json():
    """transformers 4.5x: rope_theta (global), rope_local_base_freq, rope_scaling for the
    global layers, sliding_window_pattern; no layer_types."""
    c = config(model_type="gemma3_text", head_dim=16, rope_theta=1e6, rope_local_base_freq=1e4,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=512,
               sliding_window_pattern=2, query_pre_attn_scalar=16)
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling.rope_type, c.rope_scaling.factor) == (
        1e6, 1e4, "linear", 8.0)
    assert c.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert [c.layer_window(i) for i in range(4)] == [512, None, 512, None]
    assert c.uniform_sliding_window is None and c.tie_word_embeddings
    assert c.hidden_act == "gelu_pytorch_tanh" and c.query_pre_attn_scalar == 16
    assert c.attn_logit_softcapping is None and c.final_logit_softcapping is None


def test_gemma3_with_a_vision_tower_is_refused():
    with pytest.raises(ValueError, match="gemma3_text"):
        config(model_type="gemma3_text", text_config={"hidden_size": 64})


def test_gemma2_defaults_follow_transformers():
    c = config(model_type="gemma2", head_dim=16)
    assert c.layer_types == (SLIDING, FULL, SLIDING, FULL) and c.sliding_window == 4096
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)
    assert c.query_pre_attn_scalar == 256 and c.tie_word_embeddings


def test_mistral_window_defaults_to_4096_and_null_means_none():
    assert config(model_type="mistral").uniform_sliding_window == 4096
    assert config(model_type="mistral", sliding_window=None).sliding_window is None


def test_qwen2_sliding_layers_only_with_use_sliding_window():
    assert config(model_type="qwen2", sliding_window=32).sliding_window is None
    c = config(model_type="qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=2)
    assert c.layer_types == (FULL, FULL, SLIDING, SLIDING) and c.attention_bias
    assert c.uniform_sliding_window is None


def test_phi3_su_scaling_is_longrope_with_the_original_context():
    c = config(model_type="phi3", original_max_position_embeddings=64,
               rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})
    assert c.rope_scaling.rope_type == "longrope"
    assert c.rope_scaling.original_max_position_embeddings == 64
    assert c.rms_norm_eps == 1e-5 and not c.tie_word_embeddings


@pytest.mark.parametrize("raw, match", [
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
    ({"model_type": "gemma2", "hidden_activation": "gelu"}, "hidden_activation"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ({"model_type": "mistral", "layer_types": [FULL] * 4}, "layer_types"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
])
def test_unsupported_settings_name_the_field(raw, match):
    with pytest.raises(ValueError, match=match):
        config(**raw)


ROPES = {
    "linear": {"factor": 4.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 64},
    "longrope": {"short_factor": [1.0 + 0.1 * i for i in range(8)],
                 "long_factor": [2.0 + 0.3 * i for i in range(8)],
                 "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_variants_equal_transformers_bit_for_bit(kind):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": kind, "rope_theta": 5e5, **ROPES[kind]}
    ref_config = LlamaConfig(**BASE, head_dim=16, rope_parameters=dict(params))
    want, want_scale = ROPE_INIT_FUNCTIONS[kind](ref_config, torch.device("cpu"))
    ours = config(model_type="llama", head_dim=16, rope_parameters=params)
    got, long, scale = inv_freq(16, ours.rope_theta, ours.rope_scaling, 256)
    assert torch.equal(got, want) and scale == pytest.approx(want_scale, rel=1e-12)
    if kind == "longrope":  # past the original length: transformers' long factors
        want_long, _ = ROPE_INIT_FUNCTIONS[kind](ref_config, torch.device("cpu"), seq_len=65)
        assert torch.equal(long, want_long)
        rope = RotaryEmbedding(16, 256, ours.rope_theta, ours.rope_scaling)
        assert torch.equal(rope.cos[63, :8], (63 * want).cos() * want_scale)
        assert torch.equal(rope.cos[64, :8], (64 * want_long).cos() * want_scale)
