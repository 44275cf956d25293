"""The engine's ``dtype`` / ``quantization`` settings: precision choice, GGUF blocks kept as
stored, resident weight bytes, and a quantized engine that generates and frees its blocks."""
from __future__ import annotations

import functools
import os

import pytest
import torch

from kernels import quant
from services.engine.engine import EngineConfig, LLMEngine, resolve_kv_cache_dtype
from services.engine.gguf_file import GGUFFile
from services.engine.loader import load_model
from services.engine.model_files import default_model_path
from services.engine.quantized import (Precision, QuantLinear, cpu_has_native_bf16,
                                       resolve_precision, resident_weight_bytes)
from services.engine.quantized_loader import file_weight_formats, load_gguf_quantized
from services.engine.sampling_params import SamplingParams


@functools.cache
def dense_weights():
    return load_model(default_model_path())


@pytest.mark.parametrize("field,kw", [("dtype", {"dtype": "float16"}),
                                      ("quantization", {"quantization": "q5_k"})])
def test_bad_settings_name_the_field(field, kw):
    args = {"dtype": "float32", "quantization": "none", **kw}
    with pytest.raises(ValueError, match=field):
        resolve_precision(args["dtype"], args["quantization"], {"q4_1"}, "cpu")


def test_auto_serves_the_files_format_and_none_stays_float32():
    assert file_weight_formats(default_model_path()) == {"q4_1"}
    auto = resolve_precision("auto", "auto", {"q4_1"}, "cpu")
    assert auto.quantization == ("q4_1" if quant.available() else "none")
    assert auto.dtype == "float32"  # quantized layers compute in int8 whatever the dtype
    dense = resolve_precision("auto", "none", {"q4_1"}, "cpu")
    assert dense.dtype == ("bfloat16" if cpu_has_native_bf16() else "float32")
    assert resolve_precision("float32", "none", {"q4_1"}, "cpu").quantization == "none"
    # a checkpoint that is not GGUF has no format to serve in place: auto does not invent one
    assert resolve_precision("float32", "auto", set(), "cpu").quantization == "none"
    # an F32 GGUF runs its float rows through the same kernels, in float32
    f32 = resolve_precision("auto", "auto", {"f32"}, "cpu")
    assert f32.quantization == ("f32" if quant.available() else "none")
    assert f32.dtype == "float32" or not quant.available()


def test_auto_reencodes_block_formats_without_a_kernel_to_q8_0():
    """llama.cpp's Q4_K_M (Q4_K and Q6_K), Q5_0 alone, or a mix of kernel formats: Q8_0 once at
    load; a file with float layers beside blocks, or a model the fused pass cannot serve, runs
    dense."""
    want = "q8_0" if quant.available() else "none"
    for formats in ({"q4_k", "q6_k"}, {"q5_0"}, {"q4_1", "q8_0"}):
        assert resolve_precision("auto", "auto", formats, "cpu").quantization == want
    assert resolve_precision("auto", "auto", {"q4_k", "f16"}, "cpu").quantization == "none"
    assert resolve_precision("float32", "auto", {"q4_k"}, "cpu", "Gemma 2").quantization == "none"
    assert resolve_precision("float32", "auto", {"q4_k"}, "cuda").quantization == "none"


def test_kv_cache_dtype_auto_is_float16_only_for_block_formats_in_the_fused_cpu_pass():
    q4, f32_rows = Precision("float32", "q4_1"), Precision("float32", "f32")
    oracle, bf16 = Precision("float32", "none"), Precision("bfloat16", "none")
    assert resolve_kv_cache_dtype("auto", q4, "cpu", True) == torch.float16
    assert resolve_kv_cache_dtype("auto", q4, "cpu", False) == torch.float32  # module path
    assert resolve_kv_cache_dtype("auto", f32_rows, "cpu", True) == torch.float32
    assert resolve_kv_cache_dtype("auto", oracle, "cpu", False) == torch.float32
    assert resolve_kv_cache_dtype("auto", bf16, "cuda", False) == torch.bfloat16
    assert resolve_kv_cache_dtype("float32", q4, "cpu", True) == torch.float32
    assert resolve_kv_cache_dtype("float16", f32_rows, "cpu", True) == torch.float16
    for kv, precision, device, fused in [("float16", oracle, "cpu", False),
                                         ("float16", bf16, "cuda", False),
                                         ("bfloat16", q4, "cpu", True),
                                         ("float32", bf16, "cuda", False)]:
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            resolve_kv_cache_dtype(kv, precision, device, fused)


def test_a_float16_kv_cache_holds_twice_the_blocks_and_the_oracle_refuses_it():
    per_block = 16 * 3 * 64 * 4 * 2 * 30  # bytes of a float32 block: K and V, 30 layers
    config = dict(dtype="auto", quantization="auto", kv_cache_memory_gib=64 * per_block / 2**30)
    half, full = (LLMEngine(EngineConfig(**config, kv_cache_dtype=kv)) for kv in ("auto", "float32"))
    if half.runner.model.fused_forward is None:
        pytest.skip("the fused C forward pass is not built here")
    assert (half.kv_cache.dtype, full.kv_cache.dtype) == (torch.float16, torch.float32)
    assert half.layout.dtype == "float16" and half.layout.block_bytes * 2 == full.layout.block_bytes
    assert (half.block_manager.num_blocks, full.block_manager.num_blocks) == (128, 64)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLMEngine(EngineConfig(dtype="float32", quantization="none", kv_cache_dtype="float16"))


def test_gguf_file_reads_what_gguf_reader_reads():
    from gguf import GGUFReader

    path = default_model_path()
    ours, theirs = GGUFFile(path), GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.type_name == b.tensor_type.name.lower()
        assert a.data.tobytes() == b.data.tobytes()
    assert ours.field("llama.block_count") == 30
    assert ours.field("tokenizer.ggml.tokens") == 49152  # a string array: its count only


def test_quantized_load_keeps_blocks_and_dequantizes_to_the_float_loader():
    config, dense, blocks = load_gguf_quantized(default_model_path(), "q4_1")
    ref_config, ref = dense_weights()
    assert config == ref_config
    assert all(t.dtype == torch.float32 and t.dim() == 1 for t in dense.values())  # norms only
    assert blocks["model.embed_tokens.weight"].fmt == "q8_0"
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(quant.dequantize(blocks[name]), ref[name]), name


def test_f32_file_is_served_in_place_through_the_kernels(f32_gguf_path):
    import numpy as np

    from services.engine import quantized_loader

    config, dense, blocks = load_gguf_quantized(f32_gguf_path, "f32")
    ref_config, ref = dense_weights()
    assert config == ref_config
    assert blocks["model.embed_tokens.weight"].fmt == "f32"
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(quant.dequantize(blocks[name]), ref[name]), name
    file_map = quantized_loader._reader(str(f32_gguf_path))._map
    assert np.shares_memory(blocks["model.layers.29.mlp.down_proj.weight"].data.numpy(), file_map)
    engine = LLMEngine(EngineConfig(model=str(f32_gguf_path), dtype="auto", quantization="auto",
                                    num_kv_blocks=64))
    if not quant.available():
        pytest.skip("no C kernel: auto serves the file dense")
    assert (engine.precision.dtype, engine.precision.quantization) == ("float32", "f32")
    assert engine.runner.model.fused_forward is not None  # the C layer loop, not torch modules
    assert engine.weight_bytes <= os.path.getsize(f32_gguf_path)
    engine.add_request(engine.make_request("q", list(range(20, 60)),
                                           SamplingParams(temperature=0, max_tokens=4)))
    while engine.has_work():
        engine.step()
    assert engine.block_manager.num_free_blocks == 64


def test_requantized_format_is_close_to_the_file():
    _, _, blocks = load_gguf_quantized(default_model_path(), "q8_0")
    w = blocks["model.layers.3.mlp.up_proj.weight"]
    assert w.fmt == "q8_0"
    ref = dense_weights()[1]["model.layers.3.mlp.up_proj.weight"]
    # Q8_0 rounds each weight to within half a step d = max|w| / 127 of its block; the codes are
    # chosen with d in float32 but stored with d in fp16 (relative error <= 2^-11), which moves
    # a code of up to 127 by at most 127 * 2^-11 * d more
    step = ref.abs().reshape(ref.shape[0], -1, 32).amax(-1, keepdim=True) / 127
    err = (quant.dequantize(w) - ref).reshape(step.shape[0], -1, 32).abs()
    assert (err <= step * (0.5 + 127 * 2**-11) + 1e-7).all()


def test_quantized_engine_generates_frees_blocks_and_reports_bytes():
    engine = LLMEngine(EngineConfig(quantization="q4_1", num_kv_blocks=64))
    assert engine.precision.quantization == "q4_1"
    linears = [m for m in engine.runner.model.modules() if isinstance(m, nn_linear())]
    assert linears == []  # no dense linear layer left: nothing expanded to float32
    assert sum(isinstance(m, QuantLinear) for m in engine.runner.model.modules()) == 30 * 4 + 1
    file_bytes = os.path.getsize(default_model_path())
    fp32_embedding = 49152 * 576 * 4
    assert engine.weight_bytes == resident_weight_bytes(engine.runner.model)
    assert engine.weight_bytes <= file_bytes + fp32_embedding
    assert engine.weight_bytes < file_bytes  # blocks as stored, plus the float32 norms
    ids = list(range(20, 60))
    engine.add_request(engine.make_request("q", ids, SamplingParams(temperature=0, max_tokens=8)))
    tokens = []
    while engine.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
    assert len(tokens) == 8
    assert engine.block_manager.num_free_blocks == 64


def nn_linear():
    return torch.nn.Linear
