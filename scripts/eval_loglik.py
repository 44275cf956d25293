"""What each precision trades: mean log-likelihood of a fixed text (``python -m scripts.eval_loglik``).

For every ``dtype:quantization`` mode, the engine's model reads ``TEXT`` (tokenized without a
chat template) in one teacher-forced prefill over its paged KV cache; the figure is the mean of
``log p(token_i | tokens_<i)`` over tokens 1..n-1, in nats per token, and its perplexity
``exp(-mean)``. ``float32:none`` is the reference (the file's weights dequantized: token-exact
with transformers); ``q4_1`` serves those same weights in place, so its gap to the reference is
the int8 rounding of the activations alone; ``q8_0`` and ``q4_0`` requantize them (a second
rounding of every weight); ``bfloat16`` rounds activations, weights and KV to 8-bit mantissas.

Prints a table and writes JSON (``--out``).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

# NOTE: fixed, plain English prose (no chat template), ~300 tokens; changing it changes every
# figure, so results are comparable only for the same TEXT
TEXT = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century and spread "
    "to Europe and North America. It replaced hand production with machines, new chemical and "
    "iron processes, steam power and the factory system. Textiles were the first industry to use "
    "modern methods, and output rose quickly. Living standards grew over the following century, "
    "although working conditions in early factories were hard and many workers, children among "
    "them, worked long hours for low pay. Railways changed how people and goods moved: a journey "
    "that had taken days by coach took hours by train, and fresh food could reach cities from "
    "farms far away. Towns grew around mills and mines, often faster than housing, water and "
    "drains could be built, and disease spread in crowded streets. Reformers wrote about these "
    "conditions, and laws slowly limited the hours of children and required inspections of "
    "factories. By the end of the nineteenth century, electricity and the internal combustion "
    "engine had begun a second wave of change, and the countries that industrialised first had "
    "become the richest in the world."
)
DEFAULT_MODES = "float32:none,bfloat16:none,float32:q4_1,float32:q8_0,float32:q4_0"


@torch.inference_mode()
def mean_log_likelihood(engine, ids: list[int]) -> float:
    """Mean ``log p(ids[i] | ids[:i])`` over ``i = 1..n-1`` in nats, one prefill of ``ids``
    over the engine's paged KV cache (blocks ``0..ceil(n / block_size) - 1``, overwritten).

    Raises ``ValueError`` when the cache has fewer blocks than ``ids`` needs.
    """
    from services.engine.attention import AttentionMetadata

    model, n, bs = engine.runner.model, len(ids), engine.config.block_size
    blocks = (n + bs - 1) // bs
    if blocks > engine.kv_cache.shape[2]:
        raise ValueError(f"ids: {n} tokens need {blocks} KV blocks, the cache has "
                         f"{engine.kv_cache.shape[2]}")
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_tables=torch.arange(blocks)[None],
                             seq_lens=torch.tensor([n]), query_start_loc=[0, n], num_decode_seqs=0)
    hidden = model(torch.tensor(ids), torch.arange(n), engine.kv_cache, meta)
    logp = model.compute_logits(hidden[:-1]).float().log_softmax(-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()


def evaluate(modes: list[str], text: str = TEXT) -> dict[str, dict]:
    """``{mode: {"resolved", "weight_bytes", "tokens", "mean_log_likelihood", "perplexity"}}``
    for each ``dtype:quantization`` in ``modes`` (engines built one at a time)."""
    from services.engine.engine import EngineConfig, LLMEngine
    from services.engine.model_files import default_model_path
    from services.engine.tokenizer import Tokenizer

    ids = Tokenizer.load(default_model_path()).encode(text)
    results = {}
    for spec in modes:
        dtype, quantization = spec.split(":")
        engine = LLMEngine(EngineConfig(dtype=dtype, quantization=quantization,
                                        num_kv_blocks=len(ids) // 16 + 2))
        ll = mean_log_likelihood(engine, ids)
        results[spec] = {"resolved": f"{engine.precision.dtype}:{engine.precision.quantization}",
                         "weight_bytes": engine.weight_bytes, "tokens": len(ids),
                         "mean_log_likelihood": ll, "perplexity": math.exp(-ll)}
        del engine
    return results


def print_table(results: dict[str, dict]) -> None:
    ref = next(iter(results.values()))["mean_log_likelihood"]
    print(f"{'mode':<18}{'resolved':<18}{'weights MB':>11}{'loglik':>9}{'delta':>9}{'ppl':>8}")
    for spec, r in results.items():
        print(f"{spec:<18}{r['resolved']:<18}{r['weight_bytes'] / 1e6:>11.1f}"
              f"{r['mean_log_likelihood']:>9.4f}{r['mean_log_likelihood'] - ref:>+9.4f}"
              f"{r['perplexity']:>8.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.eval_loglik", description=__doc__)
    p.add_argument("--modes", default=DEFAULT_MODES,
                   help="comma-separated dtype:quantization; the first is the reference")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", default="bench-results/loglik.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = evaluate(args.modes.split(","))
    print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
