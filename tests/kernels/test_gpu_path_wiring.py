"""The model's CUDA path, on the GPU when there is one, else wired as on a GPU but run on CPU
tensors in Triton's interpreter: the
Triton layer ops (fused add + RMSNorm with the residual updated in place, rotary in place in the
fused q/k/v output with the cache write, SiLU-and-multiply) and the Triton paged attention
reading the strided q, through prefill, mixed and decode steps of a tiny random Llama. The
hidden states must match the torch path's (what the CPU runs) to float32 rounding, and the KV
cache must hold the same values in the same slots."""
from __future__ import annotations

import copy

import pytest
import torch

from services.engine import layer_ops, model as model_module
from services.engine.attention import AttentionMetadata, _triton_attention
from services.engine.config import ModelConfig
from services.engine.model import LlamaForCausalLM

from .conftest import DEVICE

pytest.importorskip("triton")


def tiny_model() -> LlamaForCausalLM:
    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def triton_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window=None,
                     softcap=None):
    return _triton_attention().paged_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
        meta.query_start_loc_tensor(q.device), meta.max_query_len, meta.num_decode_seqs, scale,
        sliding_window=sliding_window, softcap=softcap)


STEPS = [  # (token ids, positions, slot mapping, block tables, seq lens, query start loc, decodes)
    # A: 7 prompt tokens in blocks [3, 5]; B: 5 in [0, 1]
    ([9, 8, 7, 6, 5, 4, 3, 10, 11, 12, 13, 14], list(range(7)) + list(range(5)),
     [12, 13, 14, 15, 20, 21, 22, 0, 1, 2, 3, 4], [[3, 5], [0, 1]], [7, 5], [0, 7, 12], 0),
    # A decodes while C prefills 4 tokens in block [6]
    ([20, 30, 31, 32, 33], [7, 0, 1, 2, 3], [23, 24, 25, 26, 27], [[3, 5], [6, 0]], [8, 4],
     [0, 1, 5], 1),
    # A, B, C decode together
    ([40, 41, 42], [8, 5, 4], [48, 5, 28], [[3, 5, 12], [0, 1, 0], [6, 7, 0]], [9, 6, 5],
     [0, 1, 2, 3], 3),
]


def run(model, monkeypatch, on_gpu_path: bool):
    """The STEPS' hidden states and the KV cache, on CPU (the GPU path runs on ``DEVICE``)."""
    device = DEVICE if on_gpu_path else torch.device("cpu")
    model = copy.deepcopy(model).to(device) if device.type == "cuda" else model
    with monkeypatch.context() as m:
        if on_gpu_path:
            m.setattr(layer_ops, "_ops", lambda t: layer_ops._triton_layer_ops())
            m.setattr(model_module, "paged_attention", triton_attention)
        kv = torch.zeros(2, 2, 16, 4, 2, 16, device=device)
        hidden = []
        with torch.inference_mode():
            for ids, pos, slots, tables, lens, qsl, nd in STEPS:
                meta = AttentionMetadata(*(torch.tensor(x, device=device)
                                           for x in (slots, tables, lens)), qsl, nd)
                hidden.append(model(torch.tensor(ids, device=device),
                                    torch.tensor(pos, device=device), kv, meta).cpu())
        return hidden, kv.cpu()


def test_the_triton_path_computes_what_the_torch_path_does(monkeypatch):
    model = tiny_model()
    want, kv_want = run(model, monkeypatch, on_gpu_path=False)
    got, kv_got = run(model, monkeypatch, on_gpu_path=True)
    for w, g in zip(want, got):
        assert (g - w).abs().max() <= 1e-4 * w.abs().max(), (g - w).abs().max()
    assert torch.equal(kv_got == 0, kv_want == 0)  # the same slots written
    assert (kv_got - kv_want).abs().max() <= 1e-4 * kv_want.abs().max()


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"])
def test_every_architecture_on_the_triton_path(arch, monkeypatch, tmp_path):
    """Each architecture's tiny checkpoint (scripts/tiny_checkpoints.py) with a 3-token window
    (Qwen: on its second layer), so the steps above slide: q/k/v bias, q/k norms, (1 + w) norms, GeGLU, soft-capping and
    windows through the Triton kernels, as on a GPU."""
    from scripts.tiny_checkpoints import save_tiny
    from services.engine.quantized import build_model

    qwen = {"use_sliding_window": True, "max_window_layers": 1} if arch.startswith("qwen") else {}
    save_tiny(arch, tmp_path, sliding_window=3, **qwen)
    model, _ = build_model(str(tmp_path), "float32", "none", "cpu")
    assert model.config.sliding_window == 3
    want, kv_want = run(model, monkeypatch, on_gpu_path=False)
    got, kv_got = run(model, monkeypatch, on_gpu_path=True)
    for w, g in zip(want, got):
        assert (g - w).abs().max() <= 1e-4 * w.abs().max(), (g - w).abs().max()
    assert torch.equal(kv_got == 0, kv_want == 0)
    assert (kv_got - kv_want).abs().max() <= 1e-4 * kv_want.abs().max()


PREFILL_STEPS = [  # as STEPS
    STEPS[0],
    # A's next 5 tokens after its 7 cached (block 6 joins its table), B's 3 after its 5
    ([15, 16, 17, 18, 19, 21, 22, 23], [7, 8, 9, 10, 11, 5, 6, 7], [23, 24, 25, 26, 27, 5, 6, 7],
     [[3, 5, 6], [0, 1, 0]], [12, 8], [0, 5, 8], 0),
    # mixed: A decodes (block 7 joins), B's 3 more tokens (block 2 joins)
    ([30, 24, 25, 26], [12, 8, 9, 10], [28, 8, 9, 10], [[3, 5, 6, 7], [0, 1, 2, 0]], [13, 11],
     [0, 1, 4], 1),
]


def test_prefill_steps_through_a_cuda_graph_s_buffers_on_the_triton_path(monkeypatch):
    """Two prefill steps (the second over both sequences' cached blocks) and a mixed one (a
    decode row first) staged into a CUDA graph's buffers (services/engine/cuda_graphs.py, run
    as a replay would but eagerly): the bucket of 16 tokens, 4, 8 and 12 padding rows, 2
    padding sequences; the query offsets read as int32 from the int64 buffer and the grid
    bounded by the bucket. The same hidden states as the unpadded steps on the Triton path
    (to the matmuls' rounding, whose rows a CPU rounds by the row count) and the same KV slots
    written: the padding rows write none."""
    from types import SimpleNamespace

    import numpy as np

    from services.engine.cuda_graphs import PREFILL, CUDAGraphRunner

    model = tiny_model().to(DEVICE)
    monkeypatch.setattr(layer_ops, "_ops", lambda t: layer_ops._triton_layer_ops())
    monkeypatch.setattr(model_module, "paged_attention", triton_attention)
    results = []
    for padded in (False, True):
        kv = torch.zeros(2, 2, 16, 4, 2, 16, device=DEVICE)
        graphs = CUDAGraphRunner(model, kv, max_num_seqs=4, max_blocks=4, max_prefill_tokens=16,
                                 capture=False)
        hidden = []
        with torch.inference_mode():
            for ids, pos, slots, tables, lens, qsl, nd in PREFILL_STEPS:
                if not padded:
                    meta = AttentionMetadata(*(torch.tensor(x, device=DEVICE)
                                               for x in (slots, tables, lens)), qsl, nd)
                    hidden.append(model(torch.tensor(ids, device=DEVICE),
                                        torch.tensor(pos, device=DEVICE), kv, meta).cpu())
                    continue
                arrays = {"input_ids": np.array(ids), "positions": np.array(pos),
                          "slot_mapping": np.array(slots), "seq_lens": np.array(lens),
                          "block_tables": np.array(tables),
                          "logits_indices": np.array(qsl[1:]) - 1,
                          "query_start_loc": np.array(qsl, np.int32)}
                key, t = graphs.stage(arrays, None)
                assert key == (PREFILL, 16)
                step = SimpleNamespace(graph=key, input_ids=t["input_ids"], attn=SimpleNamespace(
                    query_start_loc=qsl, num_decode_seqs=nd))
                out, logits = graphs.run(step)
                assert logits is None  # a prefill step's: its sampled rows' come after
                hidden.append(out.cpu())
        results.append((hidden, kv.cpu()))
    (want, kv_want), (got, kv_got) = results
    for w, g in zip(want, got):
        assert g.shape == w.shape and (g - w).abs().max() <= 1e-5 * w.abs().max()
    assert torch.equal(kv_got == 0, kv_want == 0)
    assert (kv_got - kv_want).abs().max() <= 1e-5 * kv_want.abs().max()
