"""Decode steps from padded static buffers (services/engine/cuda_graphs.py): the capture sizes,
the bucket a batch takes, and, run eagerly on CPU (``capture=False``, the same buffers and
padding as a replay), the same greedy tokens as transformers with the padding rows changing
nothing. The replay itself needs a GPU: ``test_replay_equals_eager_on_a_gpu``."""
from __future__ import annotations

import numpy as np
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


def test_stage_fills_the_graph_buffers_in_one_copy_with_padding_from_the_first_row():
    """``stage`` (run on CPU: the same layout and copies as on a GPU): a batch of 3 takes the
    bucket of 4; the first 2 rows' input ids come from the device (async scheduling), the
    third's from the host; the padding row repeats row 0 in every input; block tables land in
    their rows at the step's width; the returned inputs are the buffers' views of the step."""
    kv_cache = torch.zeros(1, 2, 8, 4, 1, 2)
    graphs = CUDAGraphRunner(None, kv_cache, max_num_seqs=4, max_blocks=6, capture=False)
    arrays = {"input_ids": np.array([77]), "positions": np.array([5, 9, 2]),
              "slot_mapping": np.array([21, 13, 6]), "seq_lens": np.array([6, 10, 3]),
              "logits_indices": np.array([0, 2]),
              "block_tables": np.array([[5, 1, 0], [3, 2, 7], [1, 0, 0]])}
    size, t = graphs.stage(arrays, torch.tensor([40, 41]))
    assert size == 4
    v = graphs.views[4]
    assert v["input_ids"].tolist() == [40, 41, 77, 40]
    assert v["positions"].tolist() == [5, 9, 2, 5] and v["seq_lens"].tolist() == [6, 10, 3, 6]
    assert v["slot_mapping"].tolist() == [21, 13, 6, 21]
    assert v["block_tables"][:, :3].tolist() == [[5, 1, 0], [3, 2, 7], [1, 0, 0], [5, 1, 0]]
    assert t["input_ids"].tolist() == [40, 41, 77] and t["logits_indices"].tolist() == [0, 2]
    assert t["block_tables"].tolist() == arrays["block_tables"].tolist()
    assert t["query_start_loc"].tolist() == [0, 1, 2, 3]
    assert all(t[k].untyped_storage().data_ptr() == graphs.buffer.untyped_storage().data_ptr()
               for k in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"))
    # every input from the host, a batch that fills its bucket, a narrower table
    size, t = graphs.stage({**arrays, "input_ids": np.array([7, 8]), "seq_lens": np.array([6, 10]),
                            "positions": np.array([5, 9]), "slot_mapping": np.array([21, 13]),
                            "logits_indices": np.array([0, 1]),
                            "block_tables": np.array([[4], [6]])}, None)
    assert size == 2 and graphs.views[2]["input_ids"].tolist() == [7, 8]
    assert t["block_tables"].tolist() == [[4], [6]] and t["seq_lens"].tolist() == [6, 10]
    assert graphs.stage({**arrays, "seq_lens": np.arange(5)}, None) is None  # no bucket of 5
