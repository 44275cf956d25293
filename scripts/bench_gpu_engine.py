"""The whole engine on a CUDA GPU in bfloat16: decode throughput with its roofline, and greedy
agreement with the float32 CPU engine.

Throughput: per batch size, ``batch`` requests of ``--prompt-len`` random tokens are prefilled,
then ``--steps`` pure decode steps are timed (tokens/s = batch * steps / seconds). The roofline
is the memory-bandwidth bound of one decode step: every weight byte plus every cached K/V byte
the batch attends to is read once from HBM, so ``tokens/s <= batch * peak_bw / (weight_bytes +
kv_bytes)``. Agreement: the 8 chat prompts of the test oracle, greedy, ``--compare-tokens``
tokens each on both engines; reports the first position where the bf16 GPU tokens leave the
fp32 CPU ones (None: identical), and whether the first 32 agree.

    python scripts/bench_gpu_engine.py --out bench-results/gpu_engine.json [--peak-gbps N]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from kernels.bench import peak_hbm_gbps
from loadtest.chat_prompts import ORACLE_PROMPTS as CHAT_PROMPTS
from scripts.gpu_precision import first_divergence
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.llm import LLM
from services.engine.sampling_params import SamplingParams
from services.startup_heap import freeze_startup_heap

MUST_MATCH = 32  # tokens per prompt that the issue asks to agree


def decode_throughput(engine: LLMEngine, batch: int, prompt_len: int, steps: int,
                      warmup: int) -> dict:
    """Prefill ``batch`` random prompts, then time ``steps`` decode-only engine steps."""
    gen = torch.Generator().manual_seed(batch)
    vocab = engine.model_config.vocab_size
    # never finish inside the window, however early a request's prefill came
    params = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - prompt_len,
                            ignore_eos=True)
    ids = [f"bench-{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(engine.make_request(request_id, prompt, params))
    started: set[str] = set()
    while len(started) < batch:  # prefill (the first-prefilled already decode meanwhile)
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    for _ in range(warmup):
        engine.step()
    requests = [engine.scheduler.requests[i] for i in ids]
    context_before = sum(r.num_tokens for r in requests)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = sum(len(o.new_token_ids) for _ in range(steps) for o in engine.step())
    seconds = time.perf_counter() - t0  # step() returns host ints: the GPU is done
    context_after = sum(r.num_tokens for r in requests)
    for request_id in ids:
        engine.abort(request_id)
    return {"batch": batch, "steps": steps, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "ms_per_step": seconds / steps * 1e3,
            "mean_context": (context_before + context_after) / 2 / batch,
            "all_running": tokens == batch * steps}


def roofline(engine: LLMEngine, batch: int, mean_context: float, peak_gbps: float) -> dict:
    """Bytes one decode step must read from HBM, and the tokens/s that bounds."""
    model = engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layout = engine.layout
    kv_bytes_per_token = 2 * layout.num_layers * layout.block_bytes // layout.block_size
    kv_bytes = batch * mean_context * kv_bytes_per_token
    step_s = (weight_bytes + kv_bytes) / (peak_gbps * 1e9)
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "roofline_ms_per_step": step_s * 1e3, "roofline_tokens_per_s": batch / step_s}


def compare_greedy(model: str | None, num_tokens: int) -> list[dict]:
    """First divergence of bf16-on-CUDA from fp32-on-CPU greedy tokens, per chat prompt."""
    conversations = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    extra = {"model": model} if model else {}
    cpu = LLM(EngineConfig(**extra)).chat(conversations, params)
    gpu = LLM(EngineConfig(device="cuda", dtype="bfloat16", **extra)).chat(conversations, params)
    rows = []
    for prompt, want, got in zip(CHAT_PROMPTS, cpu, gpu):
        diverge = first_divergence(want.token_ids, got.token_ids)
        rows.append({"prompt": prompt, "first_divergence": diverge,
                     f"first_{MUST_MATCH}_match": diverge is None or diverge >= MUST_MATCH,
                     "cpu_fp32_text": want.text, "cuda_bf16_text": got.text})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--kv-cache-gib", type=float, default=16.0)
    parser.add_argument("--compare-tokens", type=int, default=128,
                        help="greedy tokens per prompt in the bf16-vs-fp32 comparison")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="peak HBM bandwidth, GB/s (default: from the device name)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graph replays")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="wait for each step's tokens before the next step is launched")
    parser.add_argument("--skip-agreement", action="store_true",
                        help="throughput only (no bf16-vs-fp32 greedy comparison)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/gpu_engine.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu_engine needs a CUDA device: torch.cuda.is_available() is False")
    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or peak_hbm_gbps(name)
    if peak is None:
        sys.exit(f"unknown peak HBM bandwidth of {name!r}: pass --peak-gbps")

    config = EngineConfig(
        **({"model": args.model} if args.model else {}), device="cuda", dtype="bfloat16",
        kv_cache_memory_gib=args.kv_cache_gib, max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(8192, max(args.batches)), enforce_eager=args.enforce_eager,
        async_scheduling=False if args.no_async_scheduling else None)
    engine = LLMEngine(config)
    freeze_startup_heap("bench_gpu_engine")  # as a served worker does (services/runtime/serve.py)
    throughput = []
    print(f"{name}, peak {peak:.0f} GB/s; prompt {args.prompt_len} tokens, {args.steps} steps, "
          f"{'eager' if args.enforce_eager else 'CUDA graphs'}, async scheduling "
          f"{'off' if args.no_async_scheduling else 'on'}")
    print(f"{'batch':>6} {'tokens/s':>10} {'ms/step':>8} {'roofline tok/s':>15} {'% roof':>7}")
    for batch in args.batches:
        row = decode_throughput(engine, batch, args.prompt_len, args.steps, args.warmup)
        row |= roofline(engine, batch, row["mean_context"], peak)
        row["pct_of_roofline"] = 100 * row["tokens_per_s"] / row["roofline_tokens_per_s"]
        throughput.append(row)
        print(f"{batch:>6} {row['tokens_per_s']:>10.0f} {row['ms_per_step']:>8.2f} "
              f"{row['roofline_tokens_per_s']:>15.0f} {row['pct_of_roofline']:>7.1f}")
    del engine
    torch.cuda.empty_cache()

    agreement = ([] if args.skip_agreement else
                 compare_greedy(args.model, max(MUST_MATCH, args.compare_tokens)))
    print(f"\nbf16 CUDA vs fp32 CPU, greedy, {max(MUST_MATCH, args.compare_tokens)} tokens:")
    for row in agreement:
        print(f"  first divergence {str(row['first_divergence']):>5}  "
              f"first {MUST_MATCH} match: {row[f'first_{MUST_MATCH}_match']}  {row['prompt']}")
    report = {"device": name, "peak_gbps": peak, "model": config.model, "dtype": "bfloat16",
              "enforce_eager": args.enforce_eager, "async_scheduling": not args.no_async_scheduling,
              "prompt_len": args.prompt_len, "torch": torch.__version__,
              "python": platform.python_version(), "throughput": throughput,
              "greedy_agreement": agreement}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
