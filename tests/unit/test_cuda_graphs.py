"""Decode, prefill and mixed steps from padded static buffers (services/engine/cuda_graphs.py):
the capture sizes, the bucket a step takes, the capture of a mixed step's pieces (with a stand-in
for torch's graphs), and, run eagerly on CPU (``capture=False``, the same
buffers and padding as a replay), the same greedy tokens as transformers with the padding rows
and sequences changing nothing. The replay itself needs a GPU:
``test_replay_equals_eager_on_a_gpu``, ``test_prefill_replay_equals_eager_on_a_gpu`` and
``test_mixed_steps_replayed_in_pieces_give_transformers_tokens_on_a_gpu``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine.cuda_graphs import (DECODE, PREFILL, CUDAGraphRunner, capture_sizes,
                                         prefill_capture_sizes)
from services.engine.sampling_params import SamplingParams
from tests.reference import CHAT_PROMPTS, hf_greedy_outputs
from tests.unit.test_engine import GREEDY, generate_all, make_engine


def test_capture_sizes_are_vllm_s_buckets_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64)[-3:] == [48, 56, 64] and len(capture_sizes(256)) == 3 + 32


def test_prefill_capture_sizes_pad_a_step_by_less_than_half():
    assert prefill_capture_sizes(2048) == [16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768,
                                           1024, 1536, 2048]
    assert prefill_capture_sizes(8192) == prefill_capture_sizes(2048)  # larger steps: eager
    assert prefill_capture_sizes(1000) == [16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768,
                                           1000]
    assert prefill_capture_sizes(16) == [16] and prefill_capture_sizes(40) == [16, 32, 40]
    for lo, hi in zip(prefill_capture_sizes(2048), prefill_capture_sizes(2048)[1:]):
        assert hi <= 2 * lo and (lo + 1) / hi > 0.5 or lo == 16


def padded_engine(**config):
    engine = make_engine(**config)
    runner = engine.runner
    runner.graphs = CUDAGraphRunner(runner.model, runner.kv_cache, engine.config.max_num_seqs,
                                    engine.block_manager.blocks_needed(engine.max_model_len),
                                    max_prefill_tokens=engine.config.max_num_batched_tokens,
                                    capture=False)
    return engine


def test_padded_decode_steps_give_transformers_tokens(monkeypatch):
    """...with the LM head inside the decode graph: a decode step's logits are the graph's
    static output and the runner calls the head itself only for prefill steps."""
    from tests.reference import chat_prompt_ids

    engine = padded_engine(max_num_seqs=20)
    steps = record_steps(engine, monkeypatch)
    model, heads = engine.runner.model, []
    compute_logits = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda hidden, out=None: heads.append(
        out is not None) or compute_logits(hidden, out=out))
    prompts = [chat_prompt_ids(p) for p in CHAT_PROMPTS[:5]]
    assert generate_all(engine, prompts) == [list(r) for r in hf_greedy_outputs()[:5]]
    assert ((DECODE, 8), 5, 5) in steps  # decode steps of 5 sequences in the bucket of 8
    decode_steps = sum(key[0] == DECODE for key, _, _ in steps)
    assert heads.count(True) == decode_steps > 0  # into the graph's logits
    assert heads.count(False) == len(steps) - decode_steps  # prefill steps: the runner's
    assert engine.runner.graphs.logits.shape == (20, model.config.vocab_size)
    assert engine.block_manager.num_free_blocks == 256


def test_padded_prefill_steps_give_transformers_tokens(monkeypatch):
    """Prompts prefilled together in one padded step: without the prefix cache (which would
    hold the others back to share the first's system prompt), 5 prompts of 194 tokens in the
    bucket of 256 tokens and 16 sequences, its last rows and sequences padding. Transformers'
    tokens, no block left in use."""
    from tests.reference import chat_prompt_ids

    prompts = [chat_prompt_ids(p) for p in CHAT_PROMPTS[:5]]
    engine = padded_engine(max_num_seqs=16, enable_prefix_caching=False)
    steps = record_steps(engine, monkeypatch)
    assert generate_all(engine, prompts) == [list(r) for r in hf_greedy_outputs()[:5]]
    assert engine.block_manager.num_free_blocks == 256
    assert steps[0] == ((PREFILL, 256), 194, 0)
    assert all(key == (DECODE, 8) for key, n, _ in steps[1:] if n == 5)


def test_mixed_steps_in_padded_buffers_give_transformers_tokens(monkeypatch):
    """With the prefix cache the first prompt goes alone (the bucket of 48) and the others
    after it, beside its decode row: a mixed step staged into a prefill bucket's buffers (as
    a replay in pieces reads them), its decode row first. Transformers' tokens."""
    from tests.reference import chat_prompt_ids

    prompts = [chat_prompt_ids(p) for p in CHAT_PROMPTS[:5]]
    engine = padded_engine(max_num_seqs=16)
    steps = record_steps(engine, monkeypatch)
    assert generate_all(engine, prompts) == [list(r) for r in hf_greedy_outputs()[:5]]
    assert engine.block_manager.num_free_blocks == 256
    assert steps[:2] == [((PREFILL, 48), 37, 0), ((PREFILL, 96), 94, 1)]


def test_chunks_of_a_prompt_in_padded_steps_equal_eager_steps(monkeypatch):
    """One 192-token prompt in chunks of 64 tokens: prefill steps in the bucket of 64 (no
    padding row: on a CPU a matmul's rows round differently with the row count; 63 of its 64
    sequence slots padding), each chunk after the first attending to the blocks the earlier
    ones cached through the buffers' block tables: the same tokens and logprobs as the same
    engine's eager steps."""
    from tests.reference import chat_prompt_ids

    prompt = [t for p in CHAT_PROMPTS[:5] for t in chat_prompt_ids(p)][:192]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    outs = []
    for engine in (make_engine(max_num_batched_tokens=64), padded_engine(max_num_batched_tokens=64)):
        engine.add_request(engine.make_request("long", prompt, params))
        steps = record_steps(engine, monkeypatch) if engine.runner.graphs else []
        tokens, logprobs = [], []
        while engine.has_work():
            for o in engine.step():
                tokens += o.new_token_ids
                logprobs += [lp.to_dict() for lp in o.logprobs or ()]
        outs.append((tokens, logprobs))
        assert engine.block_manager.num_free_blocks == 256
    assert [s[:2] for s in steps[:4]] == [((PREFILL, 64), 64)] * 3 + [((DECODE, 1), 1)]
    assert outs[0] == outs[1] and len(outs[0][0]) == 8


def record_steps(engine, monkeypatch) -> list[tuple]:
    """(graph key, tokens, decode rows) of each step ``engine`` runs from here."""
    steps, run = [], engine.runner.graphs.run
    monkeypatch.setattr(engine.runner.graphs, "run", lambda inputs: steps.append(
        (inputs.graph, inputs.input_ids.shape[0], inputs.attn.num_decode_seqs)) or run(inputs))
    return steps


def test_only_steps_that_fit_a_bucket_take_the_buffers():
    engine = padded_engine(max_num_seqs=4, max_num_batched_tokens=100)
    graphs = engine.runner.graphs
    assert graphs.bucket(3) == 4 and graphs.bucket(4) == 4 and graphs.bucket(5) is None
    assert graphs.bucket(1) == 1 and graphs.bucket(2) == 2
    assert graphs.prefill_sizes == [16, 32, 48, 64, 96, 100]
    assert graphs.prefill_bucket(17) == 32 and graphs.prefill_bucket(100) == 100
    assert graphs.prefill_bucket(101) is None
    assert graphs.layouts[(PREFILL, 16)].seqs == 4  # at most max_num_seqs sequences


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_prefill_replay_equals_eager_on_a_gpu():
    """bf16 on the GPU: 4 prompts of 16 tokens prefilled in one step from the prefill graph of
    64 tokens (12 empty sequence slots, the bucket's attention grid), then decoded from the
    graph of 4, give the same tokens and logprobs as eager steps (the step fills its bucket,
    so the GEMMs see the same rows: cuBLAS picks its kernels by the row count). No block is
    left in use. Padding rows on the GPU: tests/integration/test_gpu_stack.py's prompts
    (float32 against transformers) are prefilled in the bucket of 48."""
    from services.engine.engine import EngineConfig, LLMEngine

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (16,), generator=gen).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)
    outs = []
    for eager in (True, False):
        engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=512,
                                        max_num_seqs=16, enforce_eager=eager,
                                        enable_prefix_caching=False))
        assert (engine.runner.graphs is None) == eager
        if not eager:
            assert {(PREFILL, 64), (DECODE, 4)} <= set(engine.runner.graphs.graphs)
        for i, ids in enumerate(prompts):
            engine.add_request(engine.make_request(f"r{i}", ids, params))
        got: dict[str, list] = {}
        while engine.has_work():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(
                    (t, lp.to_dict()) for t, lp in zip(o.new_token_ids, o.logprobs))
        outs.append(got)
        assert engine.block_manager.num_free_blocks == 512
    assert outs[0] == outs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_mixed_steps_replayed_in_pieces_give_transformers_tokens_on_a_gpu(monkeypatch):
    """float32 on the GPU (full-precision GEMMs; token-exact against transformers in the
    precision checks): the first chat prompt alone, the others beside its decode row (the
    prefix cache holds them back a step), so mixed steps replay in pieces, each layer's
    attention launched between them. Transformers' tokens, no block left in use; every
    prefill bucket has its pieces, one graph more than the model has layers."""
    from services.engine.engine import EngineConfig, LLMEngine
    from tests.reference import chat_prompt_ids

    engine = LLMEngine(EngineConfig(device="cuda", dtype="float32", num_kv_blocks=512,
                                    max_num_seqs=16))
    graphs = engine.runner.graphs
    assert sorted(graphs.pieces) == graphs.prefill_sizes
    layers = engine.model_config.num_hidden_layers
    assert all(len(p.graphs) == layers + 1 == len(p.layers) + 1 for p in graphs.pieces.values())
    replayed, replay = [], graphs._replay_pieces
    monkeypatch.setattr(graphs, "_replay_pieces", lambda pieces, meta: replayed.append(
        meta.num_decode_seqs) or replay(pieces, meta))
    prompts = [chat_prompt_ids(p) for p in CHAT_PROMPTS[:5]]
    assert generate_all(engine, prompts) == [list(r) for r in hf_greedy_outputs()[:5]]
    assert replayed and all(replayed)
    assert engine.block_manager.num_free_blocks == 512


def test_stage_fills_the_graph_buffers_in_one_copy_with_padding_from_the_first_row():
    """``stage`` (run on CPU: the same layout and copies as on a GPU): a batch of 3 takes the
    bucket of 4; the first 2 rows' input ids come from the device (async scheduling), the
    third's from the host; the padding row has row 0's position, context and block table,
    input id 0 and slot -1 (it writes no K/V); block tables land in their rows at the step's
    width; the returned inputs are the buffers' views of the step."""
    kv_cache = torch.zeros(1, 2, 8, 4, 1, 2)
    graphs = CUDAGraphRunner(None, kv_cache, max_num_seqs=4, max_blocks=6, capture=False)
    arrays = {"input_ids": np.array([77]), "positions": np.array([5, 9, 2]),
              "slot_mapping": np.array([21, 13, 6]), "seq_lens": np.array([6, 10, 3]),
              "logits_indices": np.array([0, 2]),
              "block_tables": np.array([[5, 1, 0], [3, 2, 7], [1, 0, 0]])}
    key, t = graphs.stage(arrays, torch.tensor([40, 41]))
    assert key == (DECODE, 4)
    v = graphs.views[key]
    assert v["input_ids"].tolist() == [40, 41, 77, 0]
    assert v["positions"].tolist() == [5, 9, 2, 5] and v["seq_lens"].tolist() == [6, 10, 3, 6]
    assert v["slot_mapping"].tolist() == [21, 13, 6, -1]
    assert v["block_tables"][:, :3].tolist() == [[5, 1, 0], [3, 2, 7], [1, 0, 0], [5, 1, 0]]
    assert t["input_ids"].tolist() == [40, 41, 77] and t["logits_indices"].tolist() == [0, 2]
    assert t["block_tables"].tolist() == arrays["block_tables"].tolist()
    assert t["query_start_loc"].tolist() == [0, 1, 2, 3]
    assert all(t[k].untyped_storage().data_ptr() == graphs.buffer.untyped_storage().data_ptr()
               for k in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"))
    # every input from the host, a batch that fills its bucket, a narrower table
    key, t = graphs.stage({**arrays, "input_ids": np.array([7, 8]), "seq_lens": np.array([6, 10]),
                           "positions": np.array([5, 9]), "slot_mapping": np.array([21, 13]),
                           "logits_indices": np.array([0, 1]),
                           "block_tables": np.array([[4], [6]])}, None)
    assert key == (DECODE, 2) and graphs.views[key]["input_ids"].tolist() == [7, 8]
    assert t["block_tables"].tolist() == [[4], [6]] and t["seq_lens"].tolist() == [6, 10]
    assert graphs.stage({**arrays, "seq_lens": np.arange(5)}, None) is None  # no bucket of 5


def test_stage_pads_a_prefill_step_with_tokens_and_sequences_of_nothing():
    """A prefill step of 2 sequences (5 tokens after a cached block of 4, and 3) takes the
    bucket of 16 tokens and 4 sequence slots: padding tokens write no K/V (slot -1) and sit
    in no sequence, padding sequences have no token (their offsets are the step's token
    count) and length 0; the query offsets travel as int32 in the same copy."""
    kv_cache = torch.zeros(1, 2, 8, 4, 1, 2)
    graphs = CUDAGraphRunner(None, kv_cache, max_num_seqs=4, max_blocks=6, max_prefill_tokens=24,
                             capture=False)
    assert graphs.prefill_sizes == [16, 24]
    arrays = {"input_ids": np.arange(10, 18), "positions": np.array([4, 5, 6, 7, 8, 0, 1, 2]),
              "slot_mapping": np.array([4, 5, 6, 7, 8, 12, 13, 14]), "seq_lens": np.array([9, 3]),
              "logits_indices": np.array([4, 7]), "query_start_loc": np.array([0, 5, 8], np.int32),
              "block_tables": np.array([[0, 1, 2], [3, 0, 0]])}
    key, t = graphs.stage(arrays, None)
    assert key == (PREFILL, 16)
    v = graphs.views[key]
    assert v["input_ids"].tolist() == list(range(10, 18)) + [0] * 8
    assert v["positions"].tolist() == [4, 5, 6, 7, 8, 0, 1, 2] + [0] * 8
    assert v["slot_mapping"].tolist() == [4, 5, 6, 7, 8, 12, 13, 14] + [-1] * 8
    assert v["seq_lens"].tolist() == [9, 3, 0, 0]
    assert v["query_start_loc"].dtype == torch.int32
    assert v["query_start_loc"].tolist() == [0, 5, 8, 8, 8]
    assert v["block_tables"][:2, :3].tolist() == [[0, 1, 2], [3, 0, 0]]
    assert t["input_ids"].tolist() == list(range(10, 18)) and t["seq_lens"].tolist() == [9, 3]
    assert t["query_start_loc"].tolist() == [0, 5, 8] and t["logits_indices"].tolist() == [4, 7]
    assert t["block_tables"].tolist() == arrays["block_tables"].tolist()
    assert all(t[k].untyped_storage().data_ptr() == graphs.buffer.untyped_storage().data_ptr()
               for k in t)
    # one more token than the largest bucket: eager
    longer = {**arrays, "positions": np.arange(25), "query_start_loc": np.array([0, 25], np.int32),
              "seq_lens": np.array([25]), "slot_mapping": np.arange(25), "input_ids": np.arange(25),
              "logits_indices": np.array([24]), "block_tables": np.array([[0, 1, 2, 3, 4, 5, 6]])}
    assert graphs.stage(longer, None) is None


class _FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` on a CPU: records its capture calls."""

    events: list = []

    def capture_begin(self, pool=None) -> None:
        self.events.append(("begin", pool))

    def capture_end(self) -> None:
        self.events.append(("end",))


def test_capturing_a_mixed_step_s_pieces_breaks_the_forward_at_each_attention(monkeypatch):
    """The capture's control flow on a CPU, graphs stood in for: each attention call of the
    model ends one graph and begins the next in the same pool (one more graph than layers,
    each begun and ended once, in order), each layer's K/V caches and settings are kept for
    the replay, and the model's attention is itself again afterwards. A failure in the middle
    ends the open capture, leaves no pieces (mixed steps eager) and restores the attention."""
    from services.engine import attention, model as model_module

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(_FakeGraph, "events", [])
    engine = make_engine()
    runner, layers = engine.runner, engine.model_config.num_hidden_layers
    graphs = CUDAGraphRunner(runner.model, runner.kv_cache, 4, 8, max_prefill_tokens=32,
                             capture=False)
    graphs._capture_pieces((PREFILL, 32), pool="pool")
    pieces = graphs.pieces[32]
    assert _FakeGraph.events == [("begin", "pool"), ("end",)] * (layers + 1)
    assert len(pieces.graphs) == layers + 1 and len(pieces.layers) == layers
    for i, (k_cache, v_cache, scale, window, softcap) in enumerate(pieces.layers):
        assert k_cache.data_ptr() == runner.kv_cache[i][0].data_ptr()
        assert v_cache.data_ptr() == runner.kv_cache[i][1].data_ptr()
        assert (scale, window, softcap) == (64 ** -0.5, None, None)
    assert pieces.q.shape == pieces.o.shape == (32, 9, 64) and pieces.out.shape == (32, 576)
    assert model_module.paged_attention is attention.paged_attention

    _FakeGraph.events.clear()
    mlp = runner.model.model.layers[3].mlp
    monkeypatch.setattr(mlp, "forward", lambda x: 1 / 0)
    graphs._capture_pieces((PREFILL, 16), pool="pool")
    assert 16 not in graphs.pieces and _FakeGraph.events[-1] == ("end",)
    assert _FakeGraph.events == [("begin", "pool"), ("end",)] * 5  # layers 0-3 broke, then 3 failed
    assert model_module.paged_attention is attention.paged_attention
