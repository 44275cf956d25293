"""The naive baseline vLLM and TGI report against: Hugging Face ``transformers`` ``generate``
with static, left-padded batches, greedy, on the model's device and dtype (fp32 on CPU unless
the caller moves it).

transformers is a dev/bench dependency only: it is imported lazily, inside these functions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from loadtest.workloads import BenchRequest, Workload
from services.engine.config import ModelConfig


@dataclass
class HFRunResult:
    """Throughput figures of one ``generate`` run over a whole workload."""

    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # each request's own requested (random) or real, up to EOS (chat) tokens
    generated_tokens: int  # token slots generate() produced, padding rows included
    num_batches: int


def build_hf_model(model_config: ModelConfig, state_dict: dict[str, torch.Tensor]):
    """A transformers ``LlamaForCausalLM`` (fp32, eval) holding the engine loader's weights.

    ``services.engine.loader.load_model`` weights are bit-identical to what
    ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` loads, and this is faster.
    Raises ``ValueError`` when the state dict does not match the model.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model_config
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id, pad_token_id=c.eos_token_id)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    result = model.load_state_dict(state_dict, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not (c.tie_word_embeddings and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise ValueError(f"weights do not match transformers' Llama: missing {missing[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")
    if c.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # rebuild its buffers
    return model.float().eval()


def _left_padded(batch: list[BenchRequest], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask``, both ``[batch, longest prompt]`` int64."""
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[row, width - n:] = torch.tensor(r.prompt_token_ids)
        mask[row, width - n:] = 1
    return ids, mask


def _own_output_tokens(request: BenchRequest, new_tokens: list[int], eos_id: int | None) -> int:
    """Tokens of one padded row that the request itself asked for (EOS included)."""
    if request.ignore_eos or eos_id is None or eos_id not in new_tokens:
        return min(len(new_tokens), request.max_tokens)
    return min(new_tokens.index(eos_id) + 1, request.max_tokens)


@torch.inference_mode()
def run_hf(model, workload: Workload, batch_size: int, eos_token_id: int | None) -> HFRunResult:
    """Greedy ``generate`` over ``workload`` in arrival order, ``batch_size`` requests a batch.

    ``max_new_tokens`` is the batch's longest requested output; EOS stops a row only for
    requests that do not ``ignore_eos`` (a batch stops when every row has stopped).
    """
    pad_id = eos_token_id if eos_token_id is not None else 0
    requests = list(workload.requests)
    out_tokens = generated = batches = 0
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        ids, mask = (t.to(model.device) for t in _left_padded(batch, pad_id))
        stop_at_eos = not all(r.ignore_eos for r in batch)
        out = model.generate(ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max(r.max_tokens for r in batch),
                             eos_token_id=eos_token_id if stop_at_eos else None, pad_token_id=pad_id)
        new = out[:, ids.shape[1]:]
        generated += new.numel()
        out_tokens += sum(_own_output_tokens(r, row, eos_token_id)
                          for r, row in zip(batch, new.tolist()))
        batches += 1
    elapsed = time.perf_counter() - t0
    return HFRunResult(elapsed, len(requests), workload.num_prompt_tokens, out_tokens, generated, batches)


@torch.inference_mode()
def hf_prefill_seconds(model, prompt_token_ids: list[int]) -> float:
    """Seconds of one transformers forward over the prompt (logits of the last token only)."""
    ids = torch.tensor([prompt_token_ids], device=model.device)
    t0 = time.perf_counter()
    model(ids, attention_mask=torch.ones_like(ids), logits_to_keep=1).logits.sum().item()  # waits
    return time.perf_counter() - t0
