"""Tiny random-weight checkpoints of every supported architecture, saved by transformers (a
Hugging Face directory with the built-in model's tokenizer) and converted to GGUF with gguf-py's
writer the way llama.cpp's ``convert_hf_to_gguf.py`` converts them. For the architecture tests
(transformers is the oracle) and ``scripts/bench_architectures.py``; nothing is downloaded.

    python -m scripts.tiny_checkpoints ARCH DIR [--gguf FILE --type f32|q8_0|q4_0|q4_k_m]

Weights are drawn so that greedy choices are not near-ties and the continuations do not repeat
one token: linear layers N(0, 9 / in_features) (Gemma: 16 / in_features), embeddings N(0, 1)
(Gemma, which scales them by sqrt(hidden): N(0, 0.25 / hidden)), norm weights around their
identity scale, biases N(0, 0.3). (Weaker layers let a tied head copy its input token.) Every
architecture is 2 layers of hidden 64, 4 query heads and 2 KV heads of 16, FFN 128, the
built-in tokenizer's 49,152-token vocabulary; the per-architecture settings below exercise what
differs (RoPE scaling, sliding windows of 16 tokens, soft-capping, biases, tied heads).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              pad_token_id=2)
WINDOW = 16  # tokens: shorter than the tests' prompts, so windows slide and blocks are freed

# model_type -> (transformers config class, model class, settings beyond COMMON)
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        tie_word_embeddings=False, sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        sliding_window=WINDOW, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=WINDOW, query_pre_attn_scalar=16, sliding_window_pattern=2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 100000.0}})),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        tie_word_embeddings=False, sliding_window=WINDOW, original_max_position_embeddings=128,
        # LongRoPE's factors (one per frequency) are added by hf_model
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0})),
}


def hf_model(model_type: str, seed: int = 0, **overrides: Any):
    """A transformers model of ``model_type`` (float32, eval) with the weights described above."""
    import transformers

    config_cls, model_cls, settings = ARCHITECTURES[model_type]
    settings = {**COMMON, **settings, **overrides}
    rope = settings.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":  # one factor per frequency
        half = settings["head_dim"] // 2
        settings["rope_parameters"] = {**rope,
                                       "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                       "long_factor": [2.0 + 0.5 * i for i in range(half)]}
    config = getattr(transformers, config_cls)(**settings)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    gemma = model_type.startswith("gemma")  # norms scale by (1 + w), embeddings by sqrt(hidden)
    gain, embedding = (4.0, 0.5 * config.hidden_size**-0.5) if gemma else (3.0, 1.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0 if gemma else 1.0, 0.3)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.3)
            elif "embed_tokens" in name:
                p.normal_(0.0, embedding)
            elif name == "lm_head.weight" and not config.tie_word_embeddings:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, gain * p.shape[1] ** -0.5)
    return model


@functools.cache
def _tokenizer():
    from services.engine.model_files import default_model_path
    from services.engine.tokenizer import Tokenizer

    return Tokenizer.load(default_model_path())


def save_tiny(model_type: str, path: str | os.PathLike, seed: int = 0, **overrides: Any):
    """Save a tiny ``model_type`` checkpoint with the built-in tokenizer (``tokenizer.json``,
    its chat template and special tokens) to directory ``path``; returns the transformers
    model."""
    path = Path(path)
    model = hf_model(model_type, seed, **overrides)
    model.save_pretrained(path)
    tok = _tokenizer()
    tok.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tok.backend.id_to_token(tok.bos_token_id),
        "eos_token": tok.backend.id_to_token(tok.eos_token_id),
        "chat_template": tok.chat_template}))
    return model


# --- GGUF, as llama.cpp's converter writes it ------------------------------------------------

def q4_k_m_type(name: str) -> str | None:
    """The K-quant a tensor (Hugging Face name) gets in llama.cpp's Q4_K_M mix, simplified to
    its two formats: Q6_K for the embedding, the LM head and the layers most sensitive to
    rounding (``v_proj``, ``down_proj``), Q4_K for the other linear layers, None (F32) for
    norms and biases. Every row must be a multiple of 256 weights."""
    if name in ("model.embed_tokens.weight", "lm_head.weight") or name.endswith(
            ("v_proj.weight", "down_proj.weight")):
        return "q6_k"
    return "q4_k" if name.endswith("_proj.weight") else None


def encode(w: np.ndarray, qtype: str) -> np.ndarray:
    """``w`` float32 ``[rows, n]`` in ggml block format ``qtype``: uint8 ``[rows, row bytes]``
    (gguf-py's quantizers; ``scripts.kquants`` for the K-quants, which gguf-py cannot write)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from scripts import kquants

    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype in ("q4_k", "q6_k"):
        return getattr(kquants, f"quantize_{qtype}")(w)
    return quantize(w, GGMLQuantizationType[qtype.upper()])


def as_decoded(model, ftype: str = "q4_k_m"):
    """``model`` (transformers, float32) with each weight replaced in place by what a GGUF
    written from it in ``ftype`` decodes to (gguf-py's dequantizers): the float32 oracle for
    that file. Rows are encoded independently, so llama.cpp's q/k row permutation commutes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    with torch.no_grad():
        for name, p in model.named_parameters():
            qtype = q4_k_m_type(name) if ftype == "q4_k_m" else None
            if qtype is not None:
                w = p.detach().numpy()
                p.copy_(torch.from_numpy(dequantize(encode(w, qtype),
                                                    GGMLQuantizationType[qtype.upper()])))
    return model


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``convert_hf_to_gguf.py``'s ``LlamaModel.permute`` (Hugging Face rows -> llama.cpp's)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _metadata(writer, raw: dict[str, Any], model_type: str) -> None:
    """llama.cpp's hyper-parameter keys for ``raw`` (a config.json dict)."""
    heads, layers = raw["num_attention_heads"], raw["num_hidden_layers"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    writer.add_context_length(raw["max_position_embeddings"])
    writer.add_embedding_length(raw["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(raw["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(raw["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    rope = raw.get("rope_parameters") or {}
    if model_type == "gemma3_text":
        global_rope = rope["full_attention"]
        writer.add_rope_freq_base(global_rope["rope_theta"])
        if global_rope.get("rope_type") == "linear":
            import gguf
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(global_rope["factor"])
        writer.add_sliding_window(raw["sliding_window"])
        writer.add_sliding_window_pattern(
            [t == "sliding_attention" for t in raw["layer_types"]])
        return
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(raw["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(raw["final_logit_softcapping"])
        writer.add_sliding_window(raw["sliding_window"])
    if model_type == "phi3":
        writer.add_rope_dimension_count(head_dim)
        writer.add_sliding_window(raw.get("sliding_window") or 0)
        writer.add_rope_scaling_orig_ctx_len(raw["original_max_position_embeddings"])
        factor = raw["max_position_embeddings"] / raw["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(
            float(np.sqrt(1 + np.log(factor) / np.log(raw["original_max_position_embeddings"]))))


def _extra_tensors(raw: dict[str, Any], model_type: str) -> dict[str, np.ndarray]:
    """RoPE factor tensors: Llama 3's ``rope_freqs`` (llama.cpp's divisors), Phi-3's
    LongRoPE ``rope_factors_{long,short}``."""
    rope = raw.get("rope_parameters") or {}
    if model_type == "phi3" and rope.get("rope_type") == "longrope":
        return {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
                "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)}
    if model_type == "llama" and rope.get("rope_type") == "llama3":
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        base, factor = rope["rope_theta"], rope["factor"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
        factors = []
        for freq in freqs:  # convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors
            wavelen = 2 * np.pi / freq
            if wavelen < old / high:
                factors.append(1.0)
            elif wavelen > old / low:
                factors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        return {"rope_freqs.weight": np.array(factors, dtype=np.float32)}
    return {}


def write_gguf(hf_dir: str | os.PathLike, path: str | os.PathLike, ftype: str = "f32") -> Path:
    """Convert the tiny checkpoint in ``hf_dir`` to a GGUF file at ``path``: llama.cpp's tensor
    names (gguf-py's ``TensorNameMap``) and metadata keys, Llama's q/k rows permuted and
    Gemma's norms stored plus one as its converter does, the built-in model's tokenizer
    metadata; linear layers in ``ftype`` (``f32``, ``q8_0`` or ``q4_0``, gguf-py's reference
    quantizers), everything else F32; or ``q4_k_m``: llama.cpp's mix (``q4_k_m_type``; the
    embedding and head too), with ``scripts.kquants``' encoders."""
    import gguf

    from scripts.gguf_to_f32 import _copy_fields
    from services.engine import models
    from services.engine.loader import load_hf_dir
    from services.engine.model_files import default_model_path

    raw = json.loads((Path(hf_dir) / "config.json").read_text())
    model_type = raw["model_type"]
    arch = models.by_model_type(model_type).gguf_name or "llama"  # llama.cpp: Mistral is llama
    config, state_dict = load_hf_dir(hf_dir)
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, raw, model_type)
    reader = gguf.GGUFReader(default_model_path())
    tokenizer = gguf.GGUFReader.__new__(gguf.GGUFReader)
    tokenizer.fields = {k: v for k, v in reader.fields.items() if k.startswith("tokenizer.")}
    _copy_fields(tokenizer, writer)
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch],
                                     config.num_hidden_layers)
    for name, tensor in state_dict.items():
        w = tensor.numpy().astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _llamacpp_permute(w, config.num_attention_heads if "q_proj" in name
                                  else config.num_key_value_heads)
        if model_type.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        kind = (q4_k_m_type(name) if ftype == "q4_k_m"
                else ftype if name.endswith("_proj.weight") and ftype != "f32" else None)
        if kind is not None:
            writer.add_tensor(gguf_name, encode(w, kind),
                              raw_dtype=gguf.GGMLQuantizationType[kind.upper()])
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    for name, w in _extra_tensors(raw, model_type).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_type", choices=sorted(ARCHITECTURES))
    parser.add_argument("dir")
    parser.add_argument("--gguf", help="also write a GGUF file here")
    parser.add_argument("--type", default="f32", choices=("f32", "q8_0", "q4_0", "q4_k_m"))
    args = parser.parse_args()
    save_tiny(args.model_type, args.dir)
    if args.gguf:
        write_gguf(args.dir, args.gguf, args.type)


if __name__ == "__main__":
    main()
