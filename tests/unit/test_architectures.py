"""Every supported architecture against transformers in float32, token for token.

For each, a tiny random-weight checkpoint is saved by transformers inside the test
(``scripts/tiny_checkpoints.py``: 2 layers, the built-in tokenizer, weights drawn so greedy
choices are not near-ties; nothing is downloaded). Greedy output through the engine equals
transformers' ``generate`` (batched, chunked prefill, a cached prefix), the checkpoint converted
to GGUF as llama.cpp converts it matches too in F32 and loads and runs in Q8_0 and Q4_0, and the
sliding windows (Mistral, Phi-3, Gemma's local layers) both matter and free blocks where every
layer slides. The prompts (7, 23 and 40 tokens) and 24 new tokens cross the 16-token windows.
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import pytest
import torch

from scripts.tiny_checkpoints import ARCHITECTURES, hf_model, save_tiny, write_gguf
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.loader import load_model
from services.engine.quantized_forward import SERVED, QuantizedForward
from services.engine.sampling_params import SamplingParams

ARCHS = list(ARCHITECTURES)
PROMPTS = [[5 + (i * 37 + j * 11) % 4000 for j in range(n)] for i, n in enumerate((7, 23, 40))]
NUM_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
MIN_MARGIN = 1e-3  # transformers' top-2 logit gap at every step: no near-tie decides a token


@torch.inference_mode()
def hf_greedy(model) -> list[list[int]]:
    """transformers' greedy continuation of each prompt; asserts no step is a near-tie."""
    outputs = []
    for ids in PROMPTS:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
        top2 = torch.stack(out.scores)[:, 0].topk(2).values
        assert (top2[:, 0] - top2[:, 1]).min() > MIN_MARGIN
        outputs.append(out.sequences[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(arch)``: (checkpoint directory, transformers' greedy outputs), built once."""
    @functools.cache
    def build(arch: str) -> tuple[Path, list[list[int]]]:
        path = tmp_path_factory.mktemp(arch)
        return path, hf_greedy(save_tiny(arch, path))
    return build


def run(engine: LLMEngine, prompts=PROMPTS, tag: str = "r") -> list[list[int]]:
    """Greedy tokens of ``prompts`` added at once; the engine's peak of used KV blocks is kept
    as ``engine.peak_blocks``."""
    for i, ids in enumerate(prompts):
        engine.add_request(engine.make_request(f"{tag}{i}", ids, GREEDY))
    out: dict[str, list[int]] = {}
    engine.peak_blocks = 0
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.peak_blocks = max(engine.peak_blocks, engine.block_manager.num_used_blocks)
    return [out[f"{tag}{i}"] for i in range(len(prompts))]


def engine_for(path, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"model": str(path), "num_kv_blocks": 64, "block_size": 4,
                                     **config}))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, tiny):
    path, expected = tiny(arch)
    engine = engine_for(path)
    assert engine.model_config.architecture == arch
    assert run(engine) == expected
    assert len({t for out in expected for t in out}) >= 10  # not one token over and over
    assert engine.block_manager.num_free_blocks == 64


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_a_cached_prefix_give_the_same_tokens(arch, tiny):
    path, expected = tiny(arch)
    engine = engine_for(path, max_num_batched_tokens=8)  # the 40-token prompt in 5+ chunks
    assert run(engine) == expected
    assert engine.scheduler.prefix_cache_hits == 0
    assert run(engine, tag="again") == expected  # the prompts' full blocks are cached now
    assert engine.scheduler.prefix_cache_hits > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_f32_matches_transformers(arch, tiny, tmp_path):
    path, expected = tiny(arch)
    gguf = write_gguf(path, tmp_path / f"{arch}.gguf", "f32")
    if arch == "mistral":  # llama.cpp converts Mistral to its windowless llama architecture
        expected = hf_greedy(hf_model(arch, sliding_window=None))
    engine = engine_for(gguf)
    assert run(engine) == expected
    config, _ = load_model(gguf)
    assert config.tie_word_embeddings == load_model(path)[0].tie_word_embeddings


FUSED = [a for a in ARCHS if a in SERVED]  # the fused C forward pass computes their layers


@pytest.mark.skipif(not QuantizedForward.supports(torch.float32), reason="C kernels not built")
@pytest.mark.parametrize("arch", FUSED)
def test_gguf_f32_through_the_fused_c_path_matches_transformers(arch, tiny, tmp_path):
    """float32 throughout, sums in the C kernels' order: Qwen2's bias, Qwen3's q/k norms, the
    windows (Phi-3) in C; prefill chunks of 8 tokens, then decode steps in one C call."""
    path, expected = tiny(arch)
    if arch == "mistral":
        expected = hf_greedy(hf_model(arch, sliding_window=None))
    gguf = write_gguf(path, tmp_path / f"{arch}.gguf", "f32")
    engine = engine_for(gguf, quantization="auto", max_num_batched_tokens=8)
    assert engine.precision.quantization == "f32"
    assert engine.runner.model.fused_forward is not None
    assert run(engine) == expected


@pytest.mark.skipif(not QuantizedForward.supports(torch.float32), reason="C kernels not built")
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"])
def test_the_fused_c_path_is_batch_invariant(arch, tiny, tmp_path):
    """A request's logprobs are the same bits alone and inside a batch, chunked differently."""
    path, _ = tiny(arch)
    gguf = write_gguf(path, tmp_path / f"{arch}.gguf", "q8_0")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def logprobs(engine, prompts):
        for i, ids in enumerate(prompts):
            engine.add_request(engine.make_request(f"p{i}", ids, params))
        got = {}
        while engine.has_work():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend((lp.logprob, lp.top) for lp in o.logprobs)
        return got["p0"]

    alone = logprobs(engine_for(gguf, quantization="q8_0"), [PROMPTS[2]])
    batched = logprobs(engine_for(gguf, quantization="q8_0", max_num_batched_tokens=7),
                       [PROMPTS[2], PROMPTS[0], PROMPTS[1]])
    assert alone == batched and len(alone) == 12


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_quantized_loads_and_runs(arch, fmt, tiny, tmp_path):
    path, _ = tiny(arch)
    gguf = write_gguf(path, tmp_path / f"{arch}.{fmt}.gguf", fmt)
    engine = engine_for(gguf, quantization=fmt)
    assert engine.precision.quantization == fmt
    # the fused C forward pass where it computes the layers; Gemma runs its own modules
    fused = QuantizedForward.supports(torch.float32) and arch in SERVED
    assert (engine.runner.model.fused_forward is not None) == fused
    outputs = run(engine)
    assert [len(o) for o in outputs] == [NUM_TOKENS] * len(PROMPTS)
    assert engine.block_manager.num_free_blocks == 64


K_QUANT_SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64)  # rows of 256 weights


def test_llamacpp_q4_k_m_file_matches_transformers_on_the_weights_it_decodes_to(tmp_path, caplog):
    """A Q4_K_M GGUF (Q4_K linears; Q6_K embedding, v_proj and down_proj): in the oracle mode
    its weights are gguf-py's decoding of its blocks, token for token against transformers on
    those weights; ``auto`` re-encodes them to Q8_0 and runs the fused C pass."""
    from scripts.tiny_checkpoints import as_decoded

    model = save_tiny("llama", tmp_path / "hf", **K_QUANT_SHAPE)
    gguf = write_gguf(tmp_path / "hf", tmp_path / "llama.q4_k_m.gguf", "q4_k_m")
    expected = hf_greedy(as_decoded(model))
    engine = engine_for(gguf)  # quantization none: dense float32
    assert run(engine) == expected
    with caplog.at_level(logging.INFO, logger="services.engine.quantized"):
        auto = engine_for(gguf, quantization="auto")
    assert auto.precision.quantization == ("q8_0" if QuantizedForward.supports(torch.float32) else "none")
    if auto.precision.quantization == "q8_0":
        assert auto.runner.model.fused_forward is not None
        assert "the file's q4_k/q6_k blocks" in caplog.text
    assert [len(o) for o in run(auto)] == [NUM_TOKENS] * len(PROMPTS)


@pytest.mark.skipif(not QuantizedForward.supports(torch.float32), reason="C kernels not built")
def test_auto_quantization_serves_gemma_in_place_through_the_fused_path(tiny, tmp_path):
    path, _ = tiny("gemma2")
    gguf = write_gguf(path, tmp_path / "gemma2.q8_0.gguf", "q8_0")
    engine = engine_for(gguf, quantization="auto")
    assert engine.precision.quantization == "q8_0"
    assert engine.runner.model.fused_forward is not None
    assert [len(o) for o in run(engine)] == [NUM_TOKENS] * len(PROMPTS)


def test_auto_quantization_stays_dense_where_the_fused_path_does_not_serve(tiny):
    """An architecture (or activation) the C layer loop lacks: ``auto`` runs the modules."""
    import dataclasses

    from services.engine.quantized import resolve_precision
    from services.engine.quantized_forward import unsupported_reason

    config, _ = load_model(tiny("llama")[0])
    assert unsupported_reason(config) is None
    for change in ({"architecture": "falcon"}, {"hidden_act": "relu"}):
        reason = unsupported_reason(dataclasses.replace(config, **change))
        assert reason is not None and next(iter(change.values())) in reason
        assert resolve_precision("float32", "auto", {"q8_0"}, "cpu", reason).quantization == "none"


@pytest.mark.parametrize("arch", ["mistral", "phi3", "gemma2", "gemma3_text"])
def test_the_sliding_window_matters(arch, tiny):
    """Without its window transformers answers otherwise: the tests above check the window."""
    _, expected = tiny(arch)
    no_window = ({"layer_types": ["full_attention"] * 2} if arch.startswith("gemma")
                 else {"sliding_window": None})
    assert hf_greedy(hf_model(arch, **no_window)) != expected


@pytest.mark.parametrize("arch", ["mistral", "phi3"])
def test_a_window_on_every_layer_frees_the_blocks_outside_it(arch, tiny):
    path, expected = tiny(arch)
    engine = engine_for(path)
    assert engine.scheduler.config.sliding_window == 16
    long_prompt = PROMPTS[2]  # 40 tokens + 24 new: 16 blocks of 4 without the window
    assert run(engine, [long_prompt]) == expected[2:]
    # between steps only the blocks the next token's 16-token window reaches are held
    assert engine.peak_blocks == 5
    assert engine.block_manager.num_free_blocks == 64
    full = engine_for(path, scheduling_policy="static", max_model_len=64)
    assert run(full, [long_prompt]) == expected[2:]  # static slots keep every block
    assert full.peak_blocks == 16


def test_hybrid_window_layers_keep_every_block(tiny):
    """Gemma's global layers read the whole context: nothing is freed."""
    path, _ = tiny("gemma2")
    engine = engine_for(path)
    assert engine.scheduler.config.sliding_window is None
    run(engine, [PROMPTS[2]])
    assert engine.peak_blocks == 16


def test_unsupported_architectures_are_refused_with_the_supported_list(tiny, tmp_path):
    path, _ = tiny("qwen3")
    raw = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "gpt_neox"}))
    with pytest.raises(ValueError) as err:
        load_model(tmp_path)
    assert "'gpt_neox'" in str(err.value)
    for arch in ARCHS:
        assert arch in str(err.value)


def test_generation_configs_end_of_sequence_ids_end_a_request(tiny, tmp_path):
    """Llama 3 and Gemma instruct checkpoints end a turn with an id listed only in
    generation_config.json (<|eot_id|>, <end_of_turn>): it ends the request, unless ignore_eos."""
    import shutil

    path, expected = tiny("llama")
    shutil.copytree(path, tmp_path / "llama")
    stop = expected[1][5]
    (tmp_path / "llama" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, stop]}))
    engine = engine_for(tmp_path / "llama")
    assert engine.model_config.eos_token_ids == (2, stop)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
    engine.add_request(engine.make_request("eot", PROMPTS[1], params))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert tokens == expected[1][:expected[1].index(stop) + 1]
    assert outputs[-1].finish_reason == "stop"
    assert run(engine, [PROMPTS[1]]) == expected[1:2]  # GREEDY ignores EOS
