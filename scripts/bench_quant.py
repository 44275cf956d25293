"""Quantized vs float weights, measured in one run (``python -m scripts.bench_quant``).

Per precision (dtype / quantization): worker time-to-ready (a fresh process: import, load,
warm-up), resident weight bytes, batch-1 decode TPOT and a decode-only probe at a running
batch of 64 (16-token random prompts; prefill steps excluded), at 1 and 2 torch threads; mean
log-likelihood of a fixed text (teacher-forced, nats per token); greedy first divergence from
the float32 engine (token-exact to transformers: the oracle tests) on the oracle chat prompts.
Prints a table and writes JSON (``--out``). Compare figures only within one run.

``--kernel``: instead, the matmul kernel alone at the built-in model's linear shapes (Q4_1
q/k/v, o, gate/up, down; the Q8_0 tied LM head), each in the file's layout and, where the
engine serves it repacked (``kernels.quant.decode_layout``: 16-row tiles), in that one too,
batch 1/16/64 (``--batches``: 128 and 512 are
prefill chunks), one thread, every kernel path of this build (``kernels.quant.isas()``; ``--paths``
picks some) interleaved in the same run: GOP/s (2 M N K per call)
and weight GB/s from CPU seconds per call (``time.process_time``: steady on a loaded machine),
and each path's ratio to ``scalar`` (every path sums each output in the same order).
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


def start_batch(e, batch: int, tokens: int, seed: int, tag: str = "b") -> None:
    """Add ``batch`` greedy requests (16 random prompt tokens, ``tokens`` exact output tokens
    each) and step the engine until every one has its first token: what follows is decode."""
    from services.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        ids = [rng.randrange(17, e.model_config.vocab_size) for _ in range(16)]
        e.add_request(e.make_request(f"{tag}{seed}-{i}", ids, params))
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in e.step())


def decode_rate(e, batch: int, tokens: int, seed: int = 0) -> dict:
    """Decode steps only: ``batch`` requests of 16 random prompt tokens, ``tokens`` each."""
    start_batch(e, batch, tokens, seed)
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
    from kernels import quant

    for spec in args.modes.split(","):
        dtype, quantization, *isa = spec.split(":")
        quant.set_default_isa(isa[0] if isa else None)
        row: dict = {"dtype": dtype, "quantization": quantization, "isa": isa[0] if isa else None}
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


# (name, format, output rows per part, in_features): one layer of the built-in model + LM head
KERNEL_SHAPES = [("qkv", "q4_1", (576, 192, 192), 576), ("o", "q4_1", (576,), 576),
                 ("gate_up", "q4_1", (1536, 1536), 576), ("down", "q4_1", (576,), 1536),
                 ("lm_head", "q8_0", (49152,), 576)]


def random_weight(fmt: str, n: int, k: int, seed: int):
    """Random blocks with sane fp16 scales (0.01; Q4_1 minimum -0.08): timing only."""
    from kernels import quant

    bytes_per_block = quant.FORMATS[fmt][1]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // 32, bytes_per_block), dtype=torch.uint8, generator=g)
    raw[..., 0:2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    if fmt == "q4_1":
        raw[..., 2:4] = torch.tensor([-0.08], dtype=torch.float16).view(torch.uint8)
    return quant.QuantizedWeight(raw.reshape(n, -1), fmt, n, k)


def cpu_seconds_per_call(fn, min_seconds: float) -> float:
    fn()  # warm: scratch, caches
    calls, t0 = 0, time.process_time()
    while calls < 3 or time.process_time() - t0 < min_seconds:
        fn()
        calls += 1
    return (time.process_time() - t0) / calls


def kernel_bench(args) -> dict:
    from kernels import quant

    torch.set_num_threads(1)
    paths = args.paths or quant.isas()
    if unknown := set(paths) - set(quant.isas()):
        raise SystemExit(f"--paths: {sorted(unknown)} not in this build's {quant.isas()}")
    results: dict = {"isa": quant.isa(), "paths": paths, "shapes": {}}
    for name, file_fmt, parts_rows, k in KERNEL_SHAPES:
        flat = [random_weight(file_fmt, n, k, seed=i) for i, n in enumerate(parts_rows)]
        served = quant.decode_layout(flat)
        for parts in [flat] + ([served] if served[0].fmt != file_fmt else []):
            kernel_rows(args, results, paths, name, parts, k)
    return results


def kernel_rows(args, results: dict, paths: list[str], name: str, parts: list, k: int) -> None:
    """``--kernel``'s rows for one weight (its parts) at every batch, paths interleaved."""
    from kernels import quant

    fmt = parts[0].fmt
    n, nbytes = sum(p.out_features for p in parts), sum(p.nbytes for p in parts)
    for m in args.batches:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        out = torch.empty(m, n)
        row = {}
        for _ in range(args.rounds):  # interleave the paths: load drifts hit all alike
            for isa in paths:
                s = cpu_seconds_per_call(lambda: quant.quant_matmul(x, parts, out, isa=isa),
                                         args.min_seconds)
                row[isa] = min(row.get(isa, s), s)
        base = row.get("scalar")
        entry = {isa: {"us": s * 1e6, "gop_s": 2 * m * n * k / s / 1e9,
                       "weight_gb_s": nbytes / s / 1e9,
                       "vs_scalar": base / s if base else None} for isa, s in row.items()}
        results["shapes"][f"{name} m={m}" if fmt in quant.FORMATS
                          else f"{name} {fmt} m={m}"] = entry
        print(f"{name:<8} {fmt:<7} m={m:<3} " + "  ".join(
            f"{isa}: {e['us']:8.1f} us {e['gop_s']:6.1f} GOP/s {e['weight_gb_s']:5.2f} GB/s"
            + (f" x{e['vs_scalar']:.2f}" if e["vs_scalar"] else "") for isa, e in entry.items()),
            flush=True)


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
                   "bfloat16:none", help="comma-separated dtype:quantization[:kernel path], e.g. "
                   "float32:q4_1:avx2 for the AVX2 path (kernels.quant.isas()); the "
                   "first is the greedy reference (keep float32:none first)")
    p.add_argument("--batch1-tokens", type=int, default=32)
    p.add_argument("--batch64-tokens", type=int, default=16)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--out", default="bench-results/quant.json")
    p.add_argument("--kernel", action="store_true", help="microbenchmark the matmul kernel's "
                   "paths instead (writes --out too; default bench-results/quant_kernel.json)")
    p.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 64])
    p.add_argument("--paths", type=lambda s: s.split(","), default=None, help="--kernel: "
                   "comma-separated kernel paths to time (default every path of the build; the "
                   "scalar one takes minutes at --batches 128,512)")
    p.add_argument("--rounds", type=int, default=3, help="--kernel: interleaved rounds (best kept)")
    p.add_argument("--min-seconds", type=float, default=0.2, help="--kernel: CPU s per timing")
    args = p.parse_args(argv)
    if args.kernel:
        if args.out == p.get_default("out"):
            args.out = "bench-results/quant_kernel.json"
        results = kernel_bench(args)
    else:
        results = run(args)
        print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
