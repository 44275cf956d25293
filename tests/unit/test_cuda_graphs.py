"""Decode steps from padded static buffers (services/engine/cuda_graphs.py): the capture sizes,
the bucket a batch takes, and, run eagerly on CPU (``capture=False``, the same buffers and
padding as a replay), the same greedy tokens as transformers with the padding rows changing
nothing. The replay itself needs a GPU: ``test_replay_equals_eager_on_a_gpu``."""
from __future__ import annotations

import pytest
import torch

from services.engine.cuda_graphs import CUDAGraphRunner, capture_sizes
from tests.reference import CHAT_PROMPTS, hf_greedy_outputs
from tests.unit.test_engine import GREEDY, generate_all, make_engine


def test_capture_sizes_are_vllm_s_buckets_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64)[-3:] == [48, 56, 64] and len(capture_sizes(256)) == 3 + 32


def padded_engine(**config):
    engine = make_engine(**config)
    runner = engine.runner
    runner.graphs = CUDAGraphRunner(runner.model, runner.kv_cache, engine.config.max_num_seqs,
                                    engine.block_manager.blocks_needed(engine.max_model_len),
                                    capture=False)
    return engine


def test_padded_decode_steps_give_transformers_tokens(monkeypatch):
    from tests.reference import chat_prompt_ids

    engine = padded_engine(max_num_seqs=20)
    used = []
    run = engine.runner.graphs.run
    monkeypatch.setattr(engine.runner.graphs, "run",
                        lambda inputs: used.append(inputs.input_ids.shape[0]) or run(inputs))
    prompts = [chat_prompt_ids(p) for p in CHAT_PROMPTS[:5]]
    assert generate_all(engine, prompts) == [list(r) for r in hf_greedy_outputs()[:5]]
    assert 5 in used  # decode steps of 5 sequences ran in the bucket of 8, 3 rows padding
    assert engine.block_manager.num_free_blocks == 256


def test_only_decode_steps_that_fit_a_bucket_take_the_buffers():
    engine = padded_engine(max_num_seqs=4)
    graphs = engine.runner.graphs
    assert graphs.bucket(3) == 4 and graphs.bucket(4) == 4 and graphs.bucket(5) is None
    assert graphs.bucket(1) == 1 and graphs.bucket(2) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replay_equals_eager_on_a_gpu():
    """bf16 on the GPU: graph replays give the same greedy tokens as eager steps. The 8 requests
    fill the bucket of 8, so the GEMMs see the same rows; the graphs' block tables are the
    model's full width, which changed the decode attention's splits (and tokens, on the H100
    on 2026-11-27) until the splits followed each sequence's own length."""
    from services.engine.engine import EngineConfig, LLMEngine
    from tests.reference import chat_prompt_ids

    prompts = [chat_prompt_ids(p) for p in CHAT_PROMPTS]
    outs = []
    for eager in (True, False):
        engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=512,
                                        max_num_seqs=16, enforce_eager=eager))
        assert (engine.runner.graphs is None) == eager
        outs.append(generate_all(engine, prompts, GREEDY))
    assert outs[0] == outs[1]
