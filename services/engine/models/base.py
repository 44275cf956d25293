"""What every architecture module declares, and the config parsing they share.

An ``Architecture`` names its Hugging Face ``model_type`` and llama.cpp ``general.architecture``,
its model class, how its ``config.json`` and GGUF metadata become a ``ModelConfig``, and how a
GGUF file's tensors differ from the Hugging Face ones (llama.cpp's rotary row order for Llama,
Gemma's norms stored as ``1 + w``). Tensor names are mapped by gguf-py's ``TensorNameMap``,
llama.cpp's own table of Hugging Face names per architecture.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import RopeScaling
from ..model import LlamaForCausalLM

# GGUF metadata reader: key -> value (default when absent)
Metadata = Callable[..., Any]


@dataclass(frozen=True)
class Architecture:
    """One model family the engine serves (see ``services.engine.models``)."""

    model_type: str  # config.json's model_type, also ModelConfig.architecture
    model_cls: type[LlamaForCausalLM]
    # config.json dict -> ModelConfig; raises ValueError naming an unsupported field
    config_from_hf: Callable[[dict[str, Any]], Any]
    gguf_name: str | None = None  # general.architecture of its GGUF files
    # (metadata, {tensor name: loader of its float32 values}) -> ModelConfig
    config_from_gguf: Callable[[Metadata, dict[str, Callable[[], np.ndarray]]], Any] | None = None
    # (Hugging Face name, config) -> the permutation taking a GGUF tensor's rows to HF's, or None
    gguf_row_order: Callable[[str, Any], np.ndarray | None] = lambda name, cfg: None
    # Hugging Face name -> what llama.cpp's converter added to the tensor (Gemma's norms: 1.0)
    gguf_offset: Callable[[str], float] = lambda name: 0.0


# --- config.json ----------------------------------------------------------------------------

def hf_common(raw: dict[str, Any], *, rope_params: dict[str, Any] | None = None,
              **defaults: Any) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments every architecture reads from ``config.json`` the same
    way; ``defaults``: the architecture's values for absent keys (``rms_norm_eps``,
    ``max_position_embeddings``, ``tie_word_embeddings``). ``rope_params``: the rope parameters
    to read (default: the whole config's). Raises ``ValueError`` naming a missing field."""
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "num_hidden_layers", "num_attention_heads") if raw.get(k) is None]
    if missing:
        raise ValueError(f"config.json is missing required field(s) {', '.join(missing)}")
    num_heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id", defaults.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))

    def get(key: str, fallback: Any) -> Any:
        value = raw.get(key)
        return defaults.get(key, fallback) if value is None else value

    theta, scaling = hf_rope(raw, rope_params)
    return dict(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rope_theta=theta if theta is not None else float(defaults.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        max_position_embeddings=get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id", defaults.get("bos_token_id")),
        eos_token_id=eos_ids[0] if eos_ids else None,  # NOTE: of several, the first is primary
        eos_token_ids=eos_ids,
    )


def hf_rope(raw: dict[str, Any], params: dict[str, Any] | None = None,
            ) -> tuple[float | None, RopeScaling | None]:
    """``(rope_theta, scaling)`` from ``params`` (transformers >= 5 writes ``rope_parameters``)
    or ``rope_theta`` / ``rope_scaling`` (older versions). Raises ``ValueError`` for a RoPE type
    that is not supported or a partial rotary factor."""
    if params is None:
        params = raw.get("rope_parameters") or {}
    scaling_dict = params if params.get("rope_type", params.get("type")) else (raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta"))
    for source in (params, raw):
        factor = source.get("partial_rotary_factor", 1.0)
        if factor not in (None, 1.0):
            raise ValueError(f"unsupported config.json partial_rotary_factor={factor!r}: "
                             "rotary over part of each head")
    return (None if theta is None else float(theta)), rope_scaling(scaling_dict, raw)


def rope_scaling(params: dict[str, Any], raw: dict[str, Any]) -> RopeScaling | None:
    """A ``RopeScaling`` from Hugging Face rope parameters, or None for the default."""
    from ..rotary import ROPE_TYPES

    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return None
    if kind not in ROPE_TYPES or kind == "freq_factors":
        raise ValueError(f"unsupported rope scaling in config.json: {params!r} (supported "
                         f"rope_type: {', '.join(t for t in ROPE_TYPES if t != 'freq_factors')})")
    # NOTE: Phi-3 keeps original_max_position_embeddings beside the rope parameters, and
    # transformers gives that one priority (standardize_rope_params)
    original = (raw.get("original_max_position_embeddings")
                or params.get("original_max_position_embeddings")
                or raw.get("max_position_embeddings"))
    fields = {k: params[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast",
                                     "beta_slow", "truncate", "mscale", "mscale_all_dim",
                                     "attention_factor") if params.get(k) is not None}
    return RopeScaling(kind, original_max_position_embeddings=original,
                       long_factor=tuple(params.get("long_factor") or ()),
                       short_factor=tuple(params.get("short_factor") or ()), **fields)


def check_hf(raw: dict[str, Any], **expected: Any) -> None:
    """Raise ``ValueError`` naming a ``config.json`` field whose value the architecture's model
    does not implement (``expected``: field -> the value it must have when present)."""
    for field, value in expected.items():
        if raw.get(field) is not None and raw[field] != value:
            raise ValueError(f"unsupported config.json {field}={raw[field]!r}, expected {value!r}")


def hf_layer_types(raw: dict[str, Any], num_layers: int,
                   default: Callable[[int], str]) -> tuple[str, ...]:
    """config.json's ``layer_types``, or ``default(i)`` for each layer when absent."""
    types = raw.get("layer_types")
    return tuple(types) if types else tuple(default(i) for i in range(num_layers))


# --- GGUF metadata ---------------------------------------------------------------------------

def gguf_common(meta: Metadata, arch: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments from the ``{arch}.*`` and ``tokenizer.ggml.*``
    metadata every llama.cpp architecture writes the same way. Raises ``ValueError`` naming
    a missing key or an unsupported ``{arch}.rope.scaling.type``."""

    def required(key: str) -> Any:
        value = meta(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata {arch}.{key} is missing")
        return value

    hidden = required("embedding_length")
    num_heads = required("attention.head_count")
    eos = meta("tokenizer.ggml.eos_token_id")
    vocab = meta(f"{arch}.vocab_size")
    if vocab is None:
        tokens = meta("tokenizer.ggml.tokens", [])
        vocab = tokens if isinstance(tokens, int) else len(tokens)  # GGUFFile keeps a count
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=required("feed_forward_length"),
        num_hidden_layers=required("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=meta(f"{arch}.attention.head_count_kv", num_heads),
        head_dim=meta(f"{arch}.attention.key_length", hidden // num_heads),
        rope_theta=float(meta(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=gguf_rope_scaling(meta, arch, tensors),
        rms_norm_eps=float(required("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=required("context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta("tokenizer.ggml.bos_token_id"),
        eos_token_id=eos,
        eos_token_ids=tuple(dict.fromkeys(i for i in (eos, *(meta(f"tokenizer.ggml.{k}_token_id")
                                                           for k in ("eot", "eom")))
                                          if i is not None)),
    )


def gguf_rope_scaling(meta: Metadata, arch: str, tensors: dict[str, Any]) -> RopeScaling | None:
    """The RoPE variant of a GGUF file: ``{arch}.rope.scaling.*`` metadata (linear, yarn), or
    llama.cpp's ``rope_freqs`` tensor (Llama 3's frequency divisors). Raises ``ValueError``
    naming an unsupported scaling type."""
    kind = meta(f"{arch}.rope.scaling.type", "none")
    factor = meta(f"{arch}.rope.scaling.factor")
    original = meta(f"{arch}.rope.scaling.original_context_length")
    if kind == "linear":
        return RopeScaling("linear", factor=float(factor))
    if kind == "yarn":
        return RopeScaling("yarn", factor=float(factor), original_max_position_embeddings=original)
    if kind != "none":
        raise ValueError(f"unsupported {arch}.rope.scaling.type {kind!r} (supported: none, "
                         "linear, yarn)")
    if "rope_freqs.weight" in tensors:
        factors = tensors["rope_freqs.weight"]()
        return RopeScaling("freq_factors", freq_factors=tuple(float(f) for f in factors))
    return None
