"""How fast could the engine run the offline `chat` workload on this CPU? Lower bounds for the
issue's "continuous >= 4x transformers on chat" target.

Runs the chat workload (``tandem bench offline``'s, same seed and KV memory) through the
continuous engine, greedy, and records every step's tokens. Then, on the same schedule:

1. attention-free: the same requests with their measured output lengths (``ignore_eos``), the
   model's paged attention replaced by the identity, so every step has the same batch and
   everything but attention (GEMMs, norms, rotary, sampling, scheduling) is timed;
2. GEMMs only: each step's token count pushed through every ``nn.Linear`` of the model (and
   the LM head for the rows that sample), nothing else;
3. attention memory floor: the K/V bytes the schedule must read (every decode token reads its
   whole context once per layer) at this machine's measured copy bandwidth.

(2) + (3) is what an engine doing nothing but its GEMMs (as fast as torch runs them here) and
memory-bound attention would take. Compare with ``--hf-seconds`` (transformers' chat time from
``tandem bench offline``) / 4.

    python -m loadtest.chat_floor --hf-seconds 142.3 --out bench-results/chat_floor.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

import services.engine.model as model_module
from loadtest import offline
from loadtest.workloads import chat_workload
from services.engine.engine import LLMEngine
from services.engine.loader import load_model
from services.engine.model_files import default_model_path
from services.engine.sampling_params import SamplingParams
from services.engine.tokenizer import Tokenizer


def drive(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
          tag: str) -> tuple[float, list[int], list[int]]:
    """All requests at once, step to the end. Returns seconds, output tokens per request and
    tokens computed per step (prompt chunks + decodes; prefix-cache hits are not computed)."""
    requests = [engine.make_request(f"{tag}-{i}", prompt, p)
                for i, (prompt, p) in enumerate(zip(prompts, params))]
    for r in requests:
        engine.add_request(r)
    outputs, step_tokens = [0] * len(prompts), []
    computed = -engine.scheduler.prefix_cache_hits  # prefix-cache hits are not computed
    t0 = time.perf_counter()
    while engine.has_work():
        for o in engine.step():
            outputs[int(o.request_id.rsplit("-", 1)[1])] += len(o.new_token_ids)
        now = sum(r.num_computed_tokens for r in requests) - engine.scheduler.prefix_cache_hits
        step_tokens.append(now - computed)
        computed = now
    return time.perf_counter() - t0, outputs, step_tokens


def gemm_seconds(model: nn.Module, step_rows: list[tuple[int, int]], reps: int = 5) -> float:
    """Time of every ``nn.Linear`` of ``model`` on ``(rows, lm_head_rows)`` per step."""
    linears = [m for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name != "lm_head"]
    cache: dict[tuple[int, int], float] = {}
    total = 0.0
    with torch.inference_mode():
        for rows, lm_rows in step_rows:
            if (rows, lm_rows) not in cache:
                xs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}
                head = torch.randn(lm_rows, model.lm_head.in_features)

                def run():
                    for m in linears:
                        m(xs[m.in_features])
                    model.lm_head(head)
                run()
                t0 = time.perf_counter()
                for _ in range(reps):
                    run()
                cache[rows, lm_rows] = (time.perf_counter() - t0) / reps
            total += cache[rows, lm_rows]
    return total


def copy_gbps(mib: int = 256, reps: int = 5) -> float:
    src = torch.empty(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return 2 * src.numel() * 4 * reps / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.chat_floor",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=512, help="cap on output tokens")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-seconds", type=float, default=None,
                    help="transformers' time on the same workload (from tandem bench offline)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    path = str(default_model_path())
    weights = load_model(path)
    workload = chat_workload(args.num_prompts, Tokenizer.load(path), seed=0,
                             max_output=args.max_output)
    prompts = [list(r.prompt_token_ids) for r in workload.requests]
    # the offline bench's engine: its defaults (KV memory, block size, max_num_seqs), warmed up
    bench = offline.parse_args(["--max-num-batched-tokens", str(args.max_num_batched_tokens)])

    engine = offline.Engines(bench, weights)("continuous")
    greedy = [SamplingParams(temperature=0, max_tokens=r.max_tokens) for r in workload.requests]
    real_s, lens, steps = drive(engine, prompts, greedy, "real")
    print(f"engine: {real_s:.1f} s, {sum(lens)} output tokens, {len(steps)} steps")

    real_attention = model_module.paged_attention
    model_module.paged_attention = lambda q, *_: q  # identity: attention costs nothing
    try:
        free = offline.Engines(bench, weights)("continuous")
        exact = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
        free_s, free_lens, free_steps = drive(free, prompts, exact, "free")
    finally:
        model_module.paged_attention = real_attention
    assert free_lens == lens and len(free_steps) == len(steps), "attention-free schedule differs"
    print(f"attention-free, same schedule: {free_s:.1f} s")

    # decode steps sample one row per token; prompt steps sample at most the finishing prompts
    rows = [(n, min(n, args.num_prompts)) for n in steps]
    gemm_s = gemm_seconds(engine.runner.model, rows)
    print(f"GEMMs only, same schedule: {gemm_s:.1f} s")

    cfg = engine.model_config
    kv_bytes_per_token = (2 * cfg.num_key_value_heads * cfg.head_dim * 4 * cfg.num_hidden_layers)
    context_reads = sum(o * len(p) + o * (o + 1) // 2 for o, p in zip(lens, prompts))
    gbps = copy_gbps()
    attention_floor_s = context_reads * kv_bytes_per_token / (gbps * 1e9)
    print(f"attention K/V reads: {context_reads * kv_bytes_per_token / 1e9:.1f} GB at "
          f"{gbps:.1f} GB/s = {attention_floor_s:.1f} s")
    result = dict(engine_s=real_s, attention_free_s=free_s, gemm_s=gemm_s,
                  prefix_cache_hit_tokens=engine.scheduler.prefix_cache_hits,
                  attention_floor_s=attention_floor_s, copy_gbps=gbps, output_tokens=sum(lens),
                  num_steps=len(steps), output_lens=lens, step_tokens=steps, threads=args.threads)
    if args.hf_seconds:
        budget = args.hf_seconds / 4
        result.update(hf_s=args.hf_seconds, budget_for_4x_s=budget)
        for name, s in (("engine", real_s), ("attention-free", free_s),
                        ("GEMMs + attention memory floor", gemm_s + attention_floor_s)):
            print(f"  {name}: {args.hf_seconds / s:.2f}x transformers (4x needs <= {budget:.1f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
