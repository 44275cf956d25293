"""Offline benchmark (``tandem bench offline``): the same seeded workloads through continuous
batching, static batching at equal KV memory, and transformers ``generate`` (static padded
batches), plus a decode-only step split at batch 64 and a single-prompt prefill probe.
``--device cuda --dtype bfloat16`` runs the engine and transformers on a GPU in bf16.

The engine is driven directly (add every request, ``while has_work(): step()``), greedy, so
runs are comparable; its figures come from ``LLMEngine.metrics``. Prints a table, the
continuous/static and continuous/HF ratios and PASS/FAIL against the issue's targets; writes
JSON (``--out``).
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import time
from pathlib import Path

import torch

from loadtest import offline_report as report
from loadtest.workloads import (FIRST_NORMAL_TOKEN, PROMPT_RANGE, BenchRequest, Workload,
                                chat_workload, random_workload)

ENGINE_SYSTEMS = ("continuous", "static")
# As many requests as --max-num-seqs: continuous batching differs from static batching most once
# requests queue behind a full batch (with 32, continuous ran all of them from the first step
# and only the tails differed). One default invocation takes ~21 minutes on this project's
# 2-core CPU, the transformers runs most of it.
DEFAULT_PROMPTS = {"random": 64, "chat": 64}
QUICK = {"num_prompts": {"random": 4, "chat": 2}, "max_output": 16, "max_prompt": 256,
         "decode_tokens": 4}
MAX_SEQ_LEN = PROMPT_RANGE[1] + 512  # tokens: the longest random request (prompt + output)
# KV memory for this many MAX_SEQ_LEN sequences: fewer than the random workload's requests, so
# static batching (a max-length slot per request) is memory-bound, as in a real deployment
DEFAULT_KV_SEQS = 24
_ids = itertools.count()  # request ids, unique per process


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench offline", description=__doc__)
    p.add_argument("--workloads", default="random,chat", help="comma-separated: random, chat")
    p.add_argument("--systems", default="continuous,static,hf",
                   help="comma-separated: continuous, static, hf")
    p.add_argument("--num-prompts", default=None, help="per workload: N for all, or random=N,chat=M "
                   f"(default {DEFAULT_PROMPTS})")
    p.add_argument("--max-output", type=int, default=512, help="cap on output tokens (random and chat)")
    p.add_argument("--max-prompt", type=int, default=PROMPT_RANGE[1], help="cap on random prompt tokens")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help=f"KV blocks of every engine run (default: {DEFAULT_KV_SEQS} sequences of the "
                        f"longest random request, {MAX_SEQ_LEN} tokens: static batching is memory-bound)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: --max-num-seqs")
    p.add_argument("--decode-batch", type=int, default=64, help="decode-only probe: requests")
    p.add_argument("--decode-tokens", type=int, default=128, help="decode-only probe: output tokens each")
    p.add_argument("--prefill-tokens", type=int, default=512, help="prefill probe: prompt length")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch threads")
    p.add_argument("--device", default="cpu", help="cpu or cuda: the engine's and transformers'")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the engine's and transformers' compute dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: built-in SmolLM2)")
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    p.add_argument("--out", default="bench-results/offline.json")
    return p


def _num_prompts(spec: str | None, quick: bool) -> dict[str, int]:
    """``"N"`` or ``"random=N,chat=M"`` -> prompts per workload. Raises ``ValueError``."""
    counts = dict(QUICK["num_prompts"] if quick else DEFAULT_PROMPTS)
    for part in filter(None, (spec or "").split(",")):
        name, _, n = part.rpartition("=")
        for key in ([name] if name else list(counts)):
            if key not in counts:
                raise ValueError(f"--num-prompts: unknown workload {key!r}")
            counts[key] = int(n)
    return counts


class Engines:
    """One warmed-up engine per scheduling policy, built on first use and shared by the runs
    (each run resets the metrics; between runs the prefix cache holds only evictable blocks)."""

    def __init__(self, args, weights) -> None:
        self.args, self.weights = args, weights
        self._engines: dict = {}

    def __call__(self, policy: str):
        from services.engine.engine import EngineConfig, LLMEngine
        from services.startup_heap import freeze_startup_heap

        if policy not in self._engines:
            a = self.args
            fields = dict(num_kv_blocks=a.num_kv_blocks, block_size=a.block_size,
                          max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                          scheduling_policy=policy, device=a.device, dtype=a.dtype)
            if a.model:
                fields["model"] = a.model
            engine = LLMEngine(EngineConfig(**fields), weights=self.weights)
            engine.warm_up()
            freeze_startup_heap(f"offline bench, {policy} engine")  # as a served worker does
            self._engines[policy] = engine
        return self._engines[policy]


def _drive(engine, requests: list[BenchRequest]) -> tuple[int, float, dict]:
    """Reset the metrics, add every request, step until done (greedy). Returns output tokens,
    wall seconds and the run's metrics (``EngineMetrics.to_dict()``, with the scheduler's
    cumulative counters turned into this run's)."""
    from services.engine.metrics import EngineMetrics
    from services.engine.sampling_params import SamplingParams

    s = engine.scheduler
    base = (s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits)
    engine.metrics = EngineMetrics()
    t0 = time.perf_counter()
    for r in requests:
        params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos)
        engine.add_request(engine.make_request(f"bench-{next(_ids)}", list(r.prompt_token_ids), params))
    out_tokens = 0
    while engine.has_work():
        out_tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - t0
    m = engine.metrics.to_dict()
    pre, queries, hits = (a - b for a, b in zip(
        (s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits), base))
    m.update(num_preemptions=pre, prefix_cache_queries=queries, prefix_cache_hits=hits,
             prefix_cache_hit_rate=hits / max(queries, 1), num_kv_blocks=engine.block_manager.num_blocks)
    return out_tokens, elapsed, m


def _random_request(rng: random.Random, prompt_len: int, max_tokens: int, vocab_size: int,
                    ) -> BenchRequest:
    """``prompt_len`` random non-control token ids, exactly ``max_tokens`` output tokens."""
    ids = tuple(rng.randrange(FIRST_NORMAL_TOKEN, vocab_size) for _ in range(prompt_len))
    return BenchRequest(ids, max_tokens, ignore_eos=True)


def run_engine(engines: Engines, policy: str, workload: Workload) -> dict:
    """One workload through the engine with ``scheduling_policy=policy``; a report row."""
    out_tokens, elapsed, m = _drive(engines(policy), list(workload.requests))
    return report.engine_row(policy, workload, out_tokens, elapsed, m)


def run_hf_system(args, hf_model, eos_id: int | None, workload: Workload) -> dict:
    from loadtest.hf_baseline import run_hf

    result = run_hf(hf_model, workload, args.hf_batch_size or args.max_num_seqs, eos_id)
    return report.hf_row(workload, result, args.hf_batch_size or args.max_num_seqs)


def measure_decode(args, engines: Engines) -> dict:
    """Decode-only step split: ``decode_batch`` requests of 16-token prompts, ``decode_tokens``
    outputs each. The prefill steps are excluded: every counted step decodes the whole batch."""
    from services.engine.sampling_params import SamplingParams

    engine = engines("continuous")
    rng = random.Random(args.seed + 1)
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    for _ in range(args.decode_batch):
        r = _random_request(rng, 16, args.decode_tokens, engine.model_config.vocab_size)
        engine.add_request(engine.make_request(f"bench-{next(_ids)}", list(r.prompt_token_ids), params))
    started: set[str] = set()
    while len(started) < args.decode_batch and engine.has_work():  # prefill: first tokens
        started.update(o.request_id for o in engine.step())
    out_tokens, elapsed, m = _drive(engine, [])
    return report.decode_row(args.decode_batch, out_tokens, elapsed, m)


def measure_prefill(args, engines: Engines, hf_model, reps: int = 3) -> dict:
    """Seconds to prefill one ``prefill_tokens`` prompt (distinct random ids each time, so no
    prefix-cache hit; best of ``reps``), in the engine and in transformers' forward."""
    from loadtest.hf_baseline import hf_prefill_seconds

    engine = engines("continuous")
    rng = random.Random(args.seed + 2)
    engine_s, hf_s = [], []
    for _ in range(reps):
        request = _random_request(rng, args.prefill_tokens, 1, engine.model_config.vocab_size)
        engine_s.append(_drive(engine, [request])[1])
        if hf_model is not None:
            hf_s.append(hf_prefill_seconds(hf_model, list(request.prompt_token_ids)))
    return report.prefill_row(args.prefill_tokens, min(engine_s), min(hf_s) if hf_s else None)


def _workloads(args, model_config, tokenizer) -> list[Workload]:
    counts = _num_prompts(args.num_prompts, args.quick)
    built = {"random": lambda n: random_workload(n, seed=args.seed, vocab_size=model_config.vocab_size,
                                                 max_output=args.max_output, max_prompt=args.max_prompt),
             "chat": lambda n: chat_workload(n, tokenizer, seed=args.seed, max_output=args.max_output)}
    names = [w for w in args.workloads.split(",") if w]
    unknown = set(names) - set(built)
    if unknown:
        raise ValueError(f"--workloads: unknown {sorted(unknown)}; choose from {sorted(built)}")
    return [built[n](counts[n]) for n in names]


def run(args) -> dict:
    """Every (workload, system) run plus the probes; returns the JSON-able results."""
    from services.engine.loader import load_model
    from services.engine.model_files import default_model_path
    from services.engine.tokenizer import Tokenizer

    systems = [s for s in args.systems.split(",") if s]
    if set(systems) - {*ENGINE_SYSTEMS, "hf"}:
        raise ValueError(f"--systems: unknown {sorted(set(systems) - {*ENGINE_SYSTEMS, 'hf'})}")
    t0, machine0 = time.perf_counter(), report.cpu_seconds()
    model_path = args.model or str(default_model_path())
    weights = load_model(model_path)
    tokenizer = Tokenizer.load(model_path)
    workloads = _workloads(args, weights[0], tokenizer)
    hf_model = None
    if "hf" in systems:
        from loadtest.hf_baseline import build_hf_model

        hf_model = build_hf_model(*weights).to(args.device, getattr(torch, args.dtype))
        hf_model.generate(torch.tensor([[17, 18, 19]], device=args.device), max_new_tokens=2,
                          do_sample=False, pad_token_id=0)  # warm-up
    engines, rows = Engines(args, weights), []
    for workload in workloads:
        for system in systems:
            cpu0 = time.process_time()
            if system == "hf":
                rows.append(run_hf_system(args, hf_model, tokenizer.eos_token_id, workload))
            else:
                rows.append(run_engine(engines, system, workload))
            # CPU time of all threads: on a shared CPU, output per CPU-second is the steadier figure
            rows[-1]["cpu_s"] = cpu_s = time.process_time() - cpu0
            rows[-1]["output_tokens_per_cpu_s"] = rows[-1]["output_tokens"] / max(cpu_s, 1e-9)
            report.print_progress(rows[-1])
            gc.collect()
    decode = measure_decode(args, engines)
    prefill = measure_prefill(args, engines, hf_model, reps=1 if args.quick else 3)
    return report.assemble(vars(args), workloads, rows, decode, prefill,
                           wall_s=time.perf_counter() - t0, cpu_before=machine0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's arguments with ``--quick`` applied and the KV memory default filled in."""
    args = build_parser().parse_args(argv)
    if args.quick:
        args.max_output = min(args.max_output, QUICK["max_output"])
        args.max_prompt = min(args.max_prompt, QUICK["max_prompt"])
        args.decode_tokens = min(args.decode_tokens, QUICK["decode_tokens"])
    args.num_kv_blocks = args.num_kv_blocks or DEFAULT_KV_SEQS * -(-MAX_SEQ_LEN // args.block_size)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results = run(args)
    report.print_all(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
