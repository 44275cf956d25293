"""Weight loaders: a llama.cpp GGUF file or a Hugging Face directory to a float32 state dict.

Both return ``(ModelConfig, state_dict)`` with Hugging Face Llama tensor names
(``model.layers.{i}.self_attn.q_proj.weight``, ...) and torch's ``[out_features, in_features]``
layout, so the model code sees one format whatever the source.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.engine.config import ModelConfig
from services.engine.gguf_metadata import gguf_field

StateDict = dict[str, torch.Tensor]

# GGUF tensor name (after ``blk.{i}.``) -> Hugging Face name (after ``model.layers.{i}.``).
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def load_model(path: str | os.PathLike) -> tuple[ModelConfig, StateDict]:
    """Load a Llama checkpoint from a ``.gguf`` file or a Hugging Face directory.

    Returns the config and a state dict of float32 tensors named as in Hugging Face's
    ``LlamaForCausalLM`` (``lm_head.weight`` only when not tied to the embedding).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is neither a ``.gguf`` file nor a directory, or the checkpoint is
            not a supported Llama model (the message names what is unsupported).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_dir():
        return load_hf_dir(path)
    if path.suffix.lower() == ".gguf":
        return load_gguf(path)
    raise ValueError(f"model path {path} is neither a .gguf file nor a Hugging Face directory")


def load_gguf(path: str | os.PathLike) -> tuple[ModelConfig, StateDict]:
    """Load a llama.cpp GGUF file of architecture ``llama``, dequantized to float32.

    Read with ``gguf_file.GGUFFile``, every tensor through ``gguf.quants.dequantize`` once; Q/K
    rows are put back from llama.cpp's rotary order to Hugging Face's (``_unpermute_rotary``):
    then bit-identical to what transformers' own GGUF loader produces.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the architecture is not ``llama``, rope scaling is set, or a tensor is
            unexpected or missing.
    """
    from .gguf_file import GGUFFile, dequantized

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    reader = GGUFFile(path)
    config = _gguf_config(reader, {t.name for t in reader.tensors})
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    state_dict: StateDict = {}
    for tensor in reader.tensors:
        weights = dequantized(tensor)
        kind = tensor.name.split(".")[-2]
        if kind in heads:
            weights = _unpermute_rotary(weights, heads[kind])
        if not weights.flags.writeable or not weights.flags.owndata:
            # NOTE: F32 tensors are read-only views of the memory map: copied to own them
            weights = np.array(weights, dtype=np.float32)
        state_dict[_hf_name(tensor.name)] = torch.from_numpy(weights)
    _check_keys(config, state_dict, source=str(path))
    return config, state_dict


def _gguf_config(reader: Any, tensor_names: set[str]) -> ModelConfig:
    """ModelConfig from the ``llama.*`` and ``tokenizer.ggml.*`` metadata of a GGUF file:
    ``reader`` is a ``gguf.GGUFReader`` or a ``gguf_file.GGUFFile``."""
    field = getattr(reader, "field", None) or (lambda key, default=None: gguf_field(reader, key, default))
    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}: only 'llama' is supported")
    rope_scaling = field("llama.rope.scaling.type", "none")
    if rope_scaling != "none":
        raise ValueError(f"unsupported llama.rope.scaling.type {rope_scaling!r}")

    def required(key: str) -> Any:
        value = field(f"llama.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata llama.{key} is missing")
        return value

    hidden = required("embedding_length")
    num_heads = required("attention.head_count")
    vocab = field("llama.vocab_size")
    if vocab is None:
        tokens = field("tokenizer.ggml.tokens", [])
        vocab = tokens if isinstance(tokens, int) else len(tokens)  # GGUFFile keeps a count
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=required("feed_forward_length"),
        num_hidden_layers=required("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=field("llama.attention.head_count_kv", num_heads),
        head_dim=field("llama.attention.key_length", hidden // num_heads),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(required("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=required("context_length"),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
    )


def _hf_name(gguf_name: str) -> str:
    """Hugging Face name of GGUF tensor ``gguf_name``; ValueError for one Llama does not have."""
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a llama model")


def _unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the Q/K row permutation of llama.cpp's ``convert_hf_to_gguf.py`` (``permute``).

    llama.cpp stores each head's rows as interleaved (even, odd) rotary pairs; Hugging Face
    stores the first halves of the pairs, then the second halves. ``weights`` is
    ``[num_heads * head_dim, in_features]``; the result has the same shape.
    """
    out_features = weights.shape[0]
    head_dim = out_features // num_heads
    w = weights.reshape(num_heads, head_dim // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weights.shape))


def load_hf_dir(path: str | os.PathLike) -> tuple[ModelConfig, StateDict]:
    """Load a Hugging Face Llama directory: ``config.json`` plus ``*.safetensors`` shards.

    Sharded checkpoints are read through ``model.safetensors.index.json``; every tensor is
    converted to float32. With tied embeddings any ``lm_head.weight`` in the files is dropped.

    Raises:
        FileNotFoundError: the directory, ``config.json`` or the safetensors files are missing.
        ValueError: ``model_type`` is not ``llama``, a config field is missing or unsupported
            (named in the message), or a tensor is unexpected or missing.
    """
    from safetensors import safe_open

    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model directory")
    config = _hf_config(json.loads(config_path.read_text()))
    state_dict: StateDict = {}
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # NOTE: old checkpoints save this buffer; the model recomputes it.
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                state_dict[name] = f.get_tensor(name).to(torch.float32)
    _check_keys(config, state_dict, source=str(path))
    return config, state_dict


def _safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of directory ``path``: the index's shards, or ``*.safetensors``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / shard for shard in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"shard {file} listed in {index.name} is missing")
    return files


def _hf_config(raw: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a ``config.json`` dict, with LlamaConfig's defaults for optional fields."""
    if raw.get("model_type") != "llama":
        raise ValueError(f"unsupported model_type {raw.get('model_type')!r}: only 'llama' is supported")
    for field, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if raw.get(field, expected) != expected:
            raise ValueError(f"unsupported config.json {field}={raw[field]!r}, expected {expected!r}")
    # NOTE: transformers >= 5 writes rope_theta inside rope_parameters; older versions at top level.
    rope = raw.get("rope_parameters") or {}
    for params in (rope, raw.get("rope_scaling") or {}):
        if params.get("rope_type", params.get("type", "default")) != "default":
            raise ValueError(f"unsupported rope scaling in config.json: {params!r}")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "num_hidden_layers", "num_attention_heads") if k not in raw]
    if missing:
        raise ValueError(f"config.json is missing required field(s) {', '.join(missing)}")
    num_heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None  # NOTE: several stop ids; the first is the primary one.
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos,
    )


def expected_keys(config: ModelConfig) -> set[str]:
    """Names of the tensors a Llama state dict with ``config`` must hold, no more, no less."""
    keys = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        keys.add("lm_head.weight")
    for i in range(config.num_hidden_layers):
        keys.update(f"model.layers.{i}.{name}" for name in _GGUF_LAYER_NAMES.values())
    return keys


def _check_keys(config: ModelConfig, state_dict: StateDict, source: str) -> None:
    """Raise ValueError naming the tensors of ``state_dict`` that ``config`` does not predict."""
    expected = expected_keys(config)
    missing = sorted(expected - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {source} does not match its config: missing {missing[:5]} "
            f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all)"
        )


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Hyper-parameters only, no weights dequantized: what the gateway needs (context length).

    Raises the same errors as ``load_model``.
    """
    path = Path(path)
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} does not exist")
        return _hf_config(json.loads(config_file.read_text()))
    if not path.is_file():
        raise FileNotFoundError(f"model path {path} does not exist")
    from .gguf_file import GGUFFile  # NOTE: skips the vocabulary: ~100x faster than GGUFReader

    reader = GGUFFile(path)
    return _gguf_config(reader, {t.name for t in reader.tensors})
