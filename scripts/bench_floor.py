"""Single-stream TPOT against the memory-bandwidth floor (issue 27), the engine in-process.

A batch-1 decode step must read every resident weight byte once (plus the sequence's KV, small
at these lengths), so ``floor = resident weight bytes / read bandwidth`` bounds its time from
below. This script measures both on this machine and prints them beside the measured TPOT:

- resident weight bytes: ``LLMEngine.weight_bytes`` in the precision asked (default: the GGUF's
  own blocks, ``--quantization auto``);
- read bandwidth: the best of ``--rounds`` ``torch.sum`` passes over a float32 buffer of
  ``--buffer-mb`` (several times any last-level cache, so every pass reads DRAM), at 1 thread and
  at the engine's thread count (a buffer the size of the weights would partly sit in cache and
  flatter the floor; reading DRAM is what a step of a larger model does), mapped as the engine
  maps its weights (``host_memory.mapped_zeros``: huge pages where the OS allows, which read
  faster than 4 KiB pages in a VM; the floor is the stricter for it);
- TPOT: batch-1 decode steps only (16 random prompt tokens, ``--tokens`` greedy tokens, EOS
  ignored), best and median over ``--rounds``, at 1 thread and at the engine's thread count.

Prints a table and writes JSON (``--out``). Compare figures within one run: bandwidth and TPOT are
measured interleaved, round by round.

    python -m scripts.bench_floor [--rounds 5] [--tokens 64] [--out bench-results/floor.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from scripts.bench_quant import decode_rate
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.host_memory import mapped_zeros


def read_gbps(buffer: torch.Tensor, threads: int) -> float:
    """GB/s of one ``torch.sum`` pass over ``buffer`` (float32) at ``threads`` threads."""
    torch.set_num_threads(threads)
    buffer.sum()  # the pages are touched already; this warms the thread team
    t0 = time.perf_counter()
    buffer.sum()
    return buffer.numel() * buffer.element_size() / (time.perf_counter() - t0) / 1e9


def run(args) -> dict:
    engine = LLMEngine(EngineConfig(dtype=args.dtype, quantization=args.quantization,
                                    num_kv_blocks=256, max_num_seqs=4))
    engine.warm_up()
    all_threads = torch.get_num_threads()
    thread_counts = sorted({1, all_threads})
    # in the weights' kind of memory (huge pages where allowed): the best read rate it gets
    buffer = mapped_zeros(args.buffer_mb * 2**20).view(torch.float32).fill_(1.0)
    gbps: dict[int, list[float]] = {t: [] for t in thread_counts}
    tpot_ms: dict[int, list[float]] = {t: [] for t in thread_counts}
    for r in range(args.rounds):  # interleaved: a noisy moment falls on both measures
        for t in thread_counts:
            gbps[t].append(read_gbps(buffer, t))
            torch.set_num_threads(t)
            tpot_ms[t].append(decode_rate(engine, 1, args.tokens, seed=r)["ms_per_step"])
    torch.set_num_threads(all_threads)
    weight_bytes = engine.weight_bytes
    rows = {}
    for t in thread_counts:
        best_bw = max(gbps[t])
        floor_ms = weight_bytes / (best_bw * 1e9) * 1e3
        best_tpot = min(tpot_ms[t])
        rows[str(t)] = {"threads": t, "read_gbps_best": best_bw, "read_gbps": gbps[t],
                        "floor_ms": floor_ms, "tpot_ms_best": best_tpot,
                        "tpot_ms_median": statistics.median(tpot_ms[t]), "tpot_ms": tpot_ms[t],
                        "tpot_over_floor": best_tpot / floor_ms}
    return {"precision": f"{engine.precision.dtype}:{engine.precision.quantization}",
            "weight_bytes": weight_bytes, "buffer_mb": args.buffer_mb, "tokens": args.tokens,
            "rounds": args.rounds, "cpu": _cpu_model(), "by_threads": rows}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return ""


def print_table(result: dict) -> None:
    print(f"{result['cpu']}; {result['precision']}: resident weights "
          f"{result['weight_bytes'] / 1e6:.1f} MB")
    print(f"{'threads':>7}{'read GB/s':>10}{'floor ms':>9}{'TPOT ms':>8}{'median':>8}{'TPOT/floor':>11}")
    for r in result["by_threads"].values():
        print(f"{r['threads']:>7}{r['read_gbps_best']:>10.1f}{r['floor_ms']:>9.2f}"
              f"{r['tpot_ms_best']:>8.2f}{r['tpot_ms_median']:>8.2f}{r['tpot_over_floor']:>11.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per TPOT round")
    p.add_argument("--buffer-mb", type=int, default=1024, help="bandwidth probe's buffer")
    p.add_argument("--out", default="bench-results/floor.json")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.tokens < 2 or args.buffer_mb < 64:
        p.error("--rounds >= 1, --tokens >= 2 and --buffer-mb >= 64")
    result = run(args)
    print_table(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
