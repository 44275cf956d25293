"""Every architecture end to end (issue 30), through real processes: gateway -> prefill -> KV
handoff -> decode, and ``tandem generate``, each equal to transformers' greedy output token for
token (float32 oracle mode). Tiny random-weight checkpoints are saved by transformers in the test
(scripts/tiny_checkpoints.py); blocks of 4 tokens, so the prompts span several KV blocks and a
sliding window (Mistral, Phi-3, Gemma's local layers) moves past some of them."""
from __future__ import annotations

import asyncio
import subprocess

import pytest
import torch

from scripts.tiny_checkpoints import ARCHITECTURES, save_tiny
from services.api import gateway_pb2
from services.engine.tokenizer import Tokenizer
from tests.integration.conftest import WORKER_ARGS, assert_all_blocks_freed, start_stack, wait_until
from tests.integration.test_routing import metric
from tests.integration.test_stack import generate
from tests.integration.up_process import TANDEM
from tests.unit.test_architectures import NUM_TOKENS, PROMPTS, hf_greedy

pytestmark = pytest.mark.integration


BS = 4  # tokens per KV block


class _Bytes(float):
    """A falsy byte count (for ``wait_until``'s message)."""

    def __bool__(self) -> bool:
        return False


def written_layer_blocks(num_tokens: int, windows: list[int | None]) -> int:
    """(layer, block) pairs a handoff writes: per layer, all of the prompt's blocks less those
    before its window of the token after the prompt (``KVReservation.num_skipped_blocks``
    where every layer slides, ``num_partial_blocks`` for the sliding layers of a mixed model);
    the last block always."""
    blocks = -(-num_tokens // BS)
    return sum(blocks - (0 if w is None else min(max(num_tokens - w + 1, 0) // BS, blocks - 1))
               for w in windows)


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window (None: it reads the whole context), from transformers'
    config: ``layer_types`` where the model has them (Gemma), else one window for all."""
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    return [window if t == "sliding_attention" else None for t in types]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_disaggregated_stack_matches_transformers(arch, tmp_path):
    """Mistral and Phi-3 slide on every layer: their handoffs skip the blocks before the window
    (6 of the 40-token prompt's 10); Gemma's sliding layers send only the blocks their window
    reads while its global layers send all; and the tokens are still transformers'."""
    model_hf = save_tiny(arch, tmp_path)
    expected = hf_greedy(model_hf)
    windows = layer_windows(model_hf.config)
    model = ["--model", str(tmp_path)]
    stack = start_stack([*WORKER_ARGS, *model, "--block-size", str(BS)], redis_url=None,
                        gateway_args=model)
    try:
        for i, (ids, want) in enumerate(zip(PROMPTS, expected)):
            request = gateway_pb2.GenerateRequest(
                request_id=f"{arch}-{i}", prompt_token_ids=ids, max_tokens=NUM_TOKENS,
                temperature=0.0, ignore_eos=True)
            tokens, _, last = asyncio.run(generate(stack.address, request))
            assert tokens == want, i
            assert last.finish_reason == "length"
        asyncio.run(assert_all_blocks_freed(stack, timeout_s=60))
        cfg = model_hf.config  # K and V of one layer's block, float32
        block_bytes = 2 * BS * cfg.num_key_value_heads * cfg.head_dim * 4
        want = block_bytes * sum(written_layer_blocks(len(ids), windows) for ids in PROMPTS)

        async def sent():  # counted once the prefill worker's write returns: soon after landing
            got = metric(stack.metrics_targets["prefill-0"], "tandem:kv_transfer_bytes_sum")
            return got == want or _Bytes(got)

        asyncio.run(wait_until(sent, 10, f"prefill-0 wrote {want} bytes of KV"))
    finally:
        stack.stop()


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_tandem_generate_runs_each_architecture_as_transformers_does(arch, tmp_path):
    model = save_tiny(arch, tmp_path)
    tok = Tokenizer.load(tmp_path)
    prompt = "The capital of France is"
    ids = tok.encode(prompt)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=0)
    expected = tok.decode(out[0, len(ids):].tolist())
    assert len(expected) > 12  # something was generated (the tiny model's text is noise)
    proc = subprocess.run([*TANDEM, "generate", prompt, "--raw", "--model", str(tmp_path),
                           "--temperature", "0", "--max-tokens", "12",
                           "--num-threads", "1", "--dtype", "float32", "--quantization", "none"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == expected + "\n"
