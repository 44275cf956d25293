"""Quantized vs float weights, measured in one run (``python -m scripts.bench_quant``).

Per precision (dtype / quantization): worker time-to-ready (a fresh process: import, load,
warm-up), resident weight bytes, batch-1 decode TPOT and a decode-only probe at a running
batch of 64 (16-token random prompts; prefill steps excluded), at 1 and 2 torch threads; mean
log-likelihood of a fixed text (teacher-forced, nats per token); greedy first divergence from
the float32 engine (token-exact to transformers: the oracle tests) on the oracle chat prompts.
Prints a table and writes JSON (``--out``). Compare figures only within one run.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from scripts.eval_loglik import TEXT, mean_log_likelihood

READY_CODE = ("import time; t = time.perf_counter(); import torch; torch.set_num_threads(1); "
              "from services.engine.engine import EngineConfig, LLMEngine; "
              "e = LLMEngine(EngineConfig(dtype={d!r}, quantization={q!r}, num_kv_blocks=512)); "
              "e.warm_up(); print(time.perf_counter() - t)")


def engine(dtype: str, quantization: str):
    from services.engine.engine import EngineConfig, LLMEngine

    e = LLMEngine(EngineConfig(dtype=dtype, quantization=quantization, num_kv_blocks=1024,
                               max_num_seqs=64))
    e.warm_up()
    return e


def time_to_ready(dtype: str, quantization: str) -> float:
    out = subprocess.run([sys.executable, "-c", READY_CODE.format(d=dtype, q=quantization)],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def decode_rate(e, batch: int, tokens: int, seed: int = 0) -> dict:
    """Decode steps only: ``batch`` requests of 16 random prompt tokens, ``tokens`` each."""
    from services.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        ids = [rng.randrange(17, e.model_config.vocab_size) for _ in range(16)]
        e.add_request(e.make_request(f"b{seed}-{i}", ids, params))
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in e.step())
    steps, out_tokens, t0 = 0, 0, time.perf_counter()
    while e.has_work():
        out_tokens += sum(len(o.new_token_ids) for o in e.step())
        steps += 1
    elapsed = time.perf_counter() - t0
    return {"tok_per_s": out_tokens / elapsed, "ms_per_step": elapsed / steps * 1e3}


def greedy(e, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from services.engine.sampling_params import SamplingParams

    outs: dict[str, list[int]] = {}
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        e.add_request(e.make_request(f"g{i}", ids, params))
    while e.has_work():
        for o in e.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [outs[f"g{i}"] for i in range(len(prompts))]


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token; ``len(a)`` when equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def run(args) -> dict:
    from loadtest.chat_prompts import ORACLE_PROMPTS
    from services.engine.model_files import default_model_path
    from services.engine.tokenizer import Tokenizer

    tok = Tokenizer.load(default_model_path())
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
               for p in ORACLE_PROMPTS]
    text_ids = tok.encode(TEXT)
    results, reference = {}, None
    for spec in args.modes.split(","):
        dtype, quantization = spec.split(":")
        row: dict = {"dtype": dtype, "quantization": quantization}
        row["time_to_ready_s"] = time_to_ready(dtype, quantization)
        e = engine(dtype, quantization)
        row["resolved"] = f"{e.precision.dtype}:{e.precision.quantization}"
        row["weight_bytes"] = e.weight_bytes
        row["mean_log_likelihood"] = mean_log_likelihood(e, text_ids)
        outs = greedy(e, prompts, args.greedy_tokens)
        reference = reference or outs
        row["first_divergence"] = [first_divergence(a, b) for a, b in zip(reference, outs)]
        for threads in (1, 2):
            torch.set_num_threads(threads)
            row[f"batch1_t{threads}"] = decode_rate(e, 1, args.batch1_tokens, seed=threads)
            row[f"batch64_t{threads}"] = decode_rate(e, 64, args.batch64_tokens, seed=10 + threads)
        results[spec] = row
        print(json.dumps(row), flush=True)
    return results


def print_table(results: dict) -> None:
    print(f"{'mode':<22}{'ready s':>8}{'MB':>8}{'loglik':>8}{'TPOT1 ms':>9}{'TPOT1 2t':>9}"
          f"{'b64 tok/s':>10}{'b64 2t':>8}  first divergence per prompt")
    for spec, r in results.items():
        print(f"{spec:<22}{r['time_to_ready_s']:>8.2f}{r['weight_bytes'] / 1e6:>8.1f}"
              f"{r['mean_log_likelihood']:>8.3f}{r['batch1_t1']['ms_per_step']:>9.1f}"
              f"{r['batch1_t2']['ms_per_step']:>9.1f}{r['batch64_t1']['tok_per_s']:>10.0f}"
              f"{r['batch64_t2']['tok_per_s']:>8.0f}  {r['first_divergence']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_quant", description=__doc__)
    p.add_argument("--modes", default="float32:none,float32:q4_1,float32:q8_0,float32:q4_0,"
                   "bfloat16:none", help="comma-separated dtype:quantization; the first is the "
                   "greedy reference (keep float32:none first)")
    p.add_argument("--batch1-tokens", type=int, default=32)
    p.add_argument("--batch64-tokens", type=int, default=16)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--out", default="bench-results/quant.json")
    args = p.parse_args(argv)
    results = run(args)
    print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
