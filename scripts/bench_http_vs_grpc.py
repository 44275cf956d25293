"""The HTTP layer's cost: TTFT and output tokens/s over OpenAI HTTP (SSE) beside gRPC, on one
stack, at each concurrency, with the same dataset (``tandem bench serve`` for every run).

    python scripts/bench_http_vs_grpc.py --concurrency 1,16 --num-prompts 64 \\
        --out bench-results/http_vs_grpc.json

Starts one stack (1 prefill + 1 decode worker, its own Redis, HTTP on a free port), then for
each concurrency runs the gRPC target and the HTTP target back to back (same prompts, same
seed, ``--request-rate inf --max-concurrency C``), prints a side-by-side table (median and p99
TTFT, median TPOT, output tok/s) and writes every run's summary to ``--out``. Measure on an
otherwise idle machine: the two targets share the workers, so a busy machine blurs the gap.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # NOTE: run as a script from anywhere; the repo is the package root

from scripts.bench_layout import free_port  # noqa: E402
from services.runtime.launcher import Stack, UpOptions  # noqa: E402

FIELDS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "output_throughput",
          "request_throughput", "completed", "failed", "total_output_tokens", "duration")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,16", help="comma-separated client counts")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run")
    p.add_argument("--dataset", default="random", help="a `tandem bench serve` dataset")
    p.add_argument("--input-len", type=int, default=128, help="random dataset: prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="random dataset: output tokens")
    p.add_argument("--worker-args", default="--num-threads 1",
                   help="flags for every worker, one string (e.g. '--num-threads 4 --kv-cache-gib 2')")
    p.add_argument("--out", default="bench-results/http_vs_grpc.json")
    return p.parse_args(argv)


def bench(target: str, concurrency: int, args: argparse.Namespace, result_dir: Path, name: str) -> dict:
    """One `tandem bench serve` run; its summary fields."""
    argv = [sys.executable, "-m", "loadtest.serve", "--target", target, "--request-rate", "inf",
            "--max-concurrency", str(concurrency), "--num-prompts", str(args.num_prompts),
            "--dataset", args.dataset, "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--seed", "0", "--num-warmups", "2",
            "--percentiles", "50,99", "--disable-progress", "--result-dir", str(result_dir),
            "--result-name", name]
    if target.startswith("http"):
        argv += ["--endpoint", "completions"]  # the same raw prompts as the gRPC target
    subprocess.run(argv, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    result = json.loads((result_dir / f"{name}.json").read_text())
    return {field: result.get(field) for field in FIELDS}


def print_table(rows: list[dict]) -> None:
    print(f"{'clients':>7} {'target':>6} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
          f"{'TPOT p50 ms':>12} {'out tok/s':>10} {'done':>5} {'failed':>6}")
    for r in rows:
        print(f"{r['concurrency']:>7} {r['protocol']:>6} {r['median_ttft_ms']:>12.1f} "
              f"{r['p99_ttft_ms']:>12.1f} {r['median_tpot_ms']:>12.1f} {r['output_throughput']:>10.1f} "
              f"{r['completed']:>5} {r['failed']:>6}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    http_port = free_port()
    stack = Stack(UpOptions(host="127.0.0.1", port=free_port(), num_prefill=1, num_decode=1,
                            redis_url=None, worker_args=args.worker_args.split(),
                            gateway_args=["--http-port", str(http_port)]))
    rows = []
    try:
        stack.start()
        stack.wait_ready()
        targets = {"grpc": f"grpc://{stack.address}", "http": f"http://127.0.0.1:{http_port}/v1"}
        with tempfile.TemporaryDirectory() as tmp:
            for c in levels:
                for protocol, target in targets.items():
                    summary = bench(target, c, args, Path(tmp), f"{protocol}-c{c}")
                    rows.append({"protocol": protocol, "concurrency": c, **summary})
                    print(f"{protocol} at {c} clients: TTFT p50 {summary['median_ttft_ms']:.1f} ms, "
                          f"{summary['output_throughput']:.1f} output tok/s", flush=True)
    finally:
        stack.stop()
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": {**vars(args), "cpu_count": os.cpu_count()}, "runs": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
