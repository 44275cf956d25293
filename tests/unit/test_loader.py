"""Weight loaders against transformers: the default GGUF file, tiny GGUF files and tiny HF dirs."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.engine.config import ModelConfig
from services.engine.loader import load_gguf, load_hf_dir, load_model


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return load_model(gguf_path)


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> dict[str, Any]:
    """transformers' own GGUF parse: config dict and dequantized tensors.

    ``load_gguf_checkpoint`` with a meta-device model is what ``from_pretrained(gguf_file=...)``
    runs inside (checked once by hand: identical tensors), in about a third of the time.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_gguf_checkpoint(str(gguf_path), return_tensors=False)["config"]
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    return {"config": config, "tensors": tensors}


def test_gguf_config_is_smollm2(ours: tuple[ModelConfig, dict]) -> None:
    config, _ = ours
    assert config == ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
        rms_norm_eps=float(np.float32(1e-5)), max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, eos_token_ids=(2,),
    )


def test_gguf_config_matches_transformers(ours: tuple[ModelConfig, dict], reference: dict) -> None:
    config, ref = ours[0], reference["config"]
    shared = [f.name for f in dataclasses.fields(ModelConfig) if f.name in ref]
    assert len(shared) >= 13
    for field in shared:
        assert getattr(config, field) == ref[field], field
    assert config.architecture == ref["model_type"] == "llama"


def test_gguf_tensors_bit_identical_to_transformers(ours: tuple[ModelConfig, dict], reference: dict) -> None:
    _, state_dict = ours
    ref = reference["tensors"]
    assert sorted(state_dict) == sorted(ref)
    assert "lm_head.weight" not in state_dict  # tied: the file has no output.weight
    assert sum(t.numel() for t in state_dict.values()) == 134_515_008
    for name, tensor in state_dict.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, ref[name]), name


def test_gguf_tensors_are_writable_and_contiguous(ours: tuple[ModelConfig, dict]) -> None:
    _, state_dict = ours
    for name, tensor in state_dict.items():
        assert tensor.is_contiguous(), name
        assert tensor.numpy().flags.writeable, name  # not a view of the read-only memory map
    assert state_dict["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert state_dict["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert state_dict["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


# --- tiny synthetic GGUF files -------------------------------------------------------------


def _llamacpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf.py`` ``LlamaModel.permute`` (HF rows -> GGUF rows)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _tiny_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """HF-layout weights: vocab 5, hidden 8, 2 heads x head_dim 6 (!= 8 / 2), 1 KV head, FFN 12."""
    shapes = {
        "token_embd.weight": (5, 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,),
        "blk.0.attn_q.weight": (12, 8), "blk.0.attn_k.weight": (6, 8), "blk.0.attn_v.weight": (6, 8),
        "blk.0.attn_output.weight": (8, 12), "blk.0.ffn_norm.weight": (8,),
        "blk.0.ffn_gate.weight": (12, 8), "blk.0.ffn_up.weight": (12, 8), "blk.0.ffn_down.weight": (8, 12),
    }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _write_gguf(path: Path, arch: str, weights: dict[str, np.ndarray], **extra_kv: Any) -> Path:
    """A GGUF file with llama metadata (no llama.vocab_size: it comes from the token list)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": 1, "embedding_length": 8, "feed_forward_length": 12,
                       "attention.head_count": 2, "attention.head_count_kv": 1,
                       "attention.key_length": 6, "context_length": 32}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c", "d", "e"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", 3)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 4)
    for key, value in extra_kv.items():
        writer.add_string(key, value)
    for name, array in weights.items():
        gguf_array = array
        if name.endswith("attn_q.weight"):
            gguf_array = _llamacpp_permute(array, 2)
        elif name.endswith("attn_k.weight"):
            gguf_array = _llamacpp_permute(array, 1)
        writer.add_tensor(name, np.ascontiguousarray(gguf_array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gguf_config_and_unpermuted_weights(tmp_path: Path) -> None:
    weights = _tiny_weights(np.random.default_rng(0))
    config, state_dict = load_gguf(_write_gguf(tmp_path / "tiny.gguf", "llama", weights))
    assert config == ModelConfig(
        vocab_size=5, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=6, rope_theta=10000.0,
        rms_norm_eps=float(np.float32(1e-5)), max_position_embeddings=32,
        tie_word_embeddings=True, bos_token_id=3, eos_token_id=4, eos_token_ids=(4,),
    )
    # Q/K went through llama.cpp's permute on the way in; the loader must undo it exactly.
    pairs = [("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("mlp.down_proj", "ffn_down")]
    for hf_name, gguf_name in pairs:
        loaded = state_dict[f"model.layers.0.{hf_name}.weight"].numpy()
        assert np.array_equal(loaded, weights[f"blk.0.{gguf_name}.weight"]), hf_name
    assert "lm_head.weight" not in state_dict


def test_tiny_gguf_with_output_weight_is_untied(tmp_path: Path) -> None:
    weights = _tiny_weights(np.random.default_rng(1))
    weights["output.weight"] = np.arange(40, dtype=np.float32).reshape(5, 8)
    config, state_dict = load_model(_write_gguf(tmp_path / "untied.gguf", "llama", weights))
    assert config.tie_word_embeddings is False
    assert torch.equal(state_dict["lm_head.weight"], torch.arange(40, dtype=torch.float32).reshape(5, 8))


def test_unsupported_gguf_architecture_is_named_with_the_supported_list(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "falcon.gguf", "falcon", _tiny_weights(np.random.default_rng(2)))
    with pytest.raises(ValueError, match="'falcon': supported are llama, qwen2, qwen3, gemma2"):
        load_model(path)


def test_gguf_with_unexpected_or_missing_tensor_fails(tmp_path: Path) -> None:
    weights = _tiny_weights(np.random.default_rng(3))
    weights["blk.0.attn_q.bias"] = np.zeros(12, dtype=np.float32)
    with pytest.raises(ValueError, match="blk.0.attn_q.bias"):
        load_gguf(_write_gguf(tmp_path / "bias.gguf", "llama", weights))
    del weights["blk.0.attn_q.bias"], weights["blk.0.ffn_down.weight"]
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight"):
        load_gguf(_write_gguf(tmp_path / "missing.gguf", "llama", weights))


def test_unsupported_rope_scaling_gguf_is_rejected(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "rope.gguf", "llama", _tiny_weights(np.random.default_rng(4)),
                       **{"llama.rope.scaling.type": "longrope"})
    with pytest.raises(ValueError, match="llama.rope.scaling.type 'longrope'"):
        load_gguf(path)


def test_missing_path_and_unknown_file_kind(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_model(tmp_path / "does-not-exist.gguf")
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "nope.gguf")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="neither a .gguf file nor a Hugging Face directory"):
        load_model(tmp_path / "weights.bin")


# --- tiny Hugging Face directories ---------------------------------------------------------


def _save_tiny_llama(path: Path, tie: bool, dtype: torch.dtype = torch.float32, **save_kwargs: Any) -> dict:
    """Save a random 2-layer LlamaForCausalLM to ``path``; return its float32 state dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=5000.0,
        rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=tie,
        bos_token_id=1, eos_token_id=[2, 3],
    )
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path, **save_kwargs)
    return {name: t.float() for name, t in model.state_dict().items()}


@pytest.mark.parametrize("tie, shard", [(True, False), (False, False), (False, True), (True, True)])
def test_hf_dir_matches_saved_model(tmp_path: Path, tie: bool, shard: bool) -> None:
    ref = _save_tiny_llama(tmp_path, tie, **({"max_shard_size": "20KB"} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == shard
    config, state_dict = load_model(tmp_path)
    assert config == ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=5000.0,
        rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=tie,
        bos_token_id=1, eos_token_id=2, eos_token_ids=(2, 3),
    )
    if tie:
        ref.pop("lm_head.weight")
    assert sorted(state_dict) == sorted(ref)
    for name, tensor in state_dict.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, ref[name]), name


def test_hf_dir_bf16_is_converted_to_float32(tmp_path: Path) -> None:
    ref = _save_tiny_llama(tmp_path, tie=False, dtype=torch.bfloat16)
    _, state_dict = load_hf_dir(tmp_path)
    for name, tensor in state_dict.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, ref[name]), name


def test_hf_dir_old_style_config(tmp_path: Path) -> None:
    """transformers 4.x wrote rope_theta at top level and no head_dim; eos may be a plain int."""
    _save_tiny_llama(tmp_path, tie=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw.pop("head_dim")
    raw.update(rope_theta=123.0, rope_scaling=None, eos_token_id=7)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config, _ = load_hf_dir(tmp_path)
    assert (config.rope_theta, config.head_dim, config.eos_token_id) == (123.0, 8, 7)


@pytest.mark.parametrize("edit, match", [
    ({"model_type": "gpt2"}, "'gpt2': supported are llama, mistral"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1.0, "factor": 8.0}}, "rope scaling"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_hf_dir_unsupported_config_names_the_field(tmp_path: Path, edit: dict, match: str) -> None:
    _save_tiny_llama(tmp_path, tie=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(edit)
    raw = {k: v for k, v in raw.items() if v is not None or k not in edit}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match):
        load_hf_dir(tmp_path)


def test_hf_dir_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    _save_tiny_llama(tmp_path, tie=True)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf_dir(tmp_path)
