"""What routing makes of a pool: ``gateway.routing`` random, load and kv on the same workers and
the same prefix-heavy workload, in one interleaved run, beside one worker alone (the ideal
prefix-cache hit rate: nothing is computed twice for lack of being in the right place).

    python -m scripts.bench_routing --layouts one,unified4,pd2x2 --routing random,load,kv \\
        --rounds 1 --result-dir bench-results/routing

Workload: ``tandem bench serve``'s ``prefix`` dataset (``--num-prefixes`` documents of
``--prefix-len`` tokens, each asked ``--num-prompts / --num-prefixes`` questions of
``--input-len`` tokens, dealt in shuffled order), ``--max-concurrency`` clients, over gRPC.
Layouts: ``one`` (1 unified worker), ``unified4`` (4 unified workers), ``pd2x2`` (2 prefill + 2
decode workers), each worker with ``--threads`` threads; every (layout, routing) pair is a fresh
stack (empty caches), and rounds repeat the whole list so the pairs interleave. Per run: prefix
hit rate (cached / prompt tokens, from each request's usage) and its ratio to ``one``'s, TTFT
p50 / p99, mean TPOT, goodput under ``--goodput``. Prints a table, writes ``routing.json`` and
each run's ``bench serve`` JSON. Figures compare only within one run; the machine should be
quiet (say so when it was not).
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import time
from pathlib import Path

from loadtest import serve
from scripts.bench_layout import free_port
from services.runtime.launcher import Stack, UpOptions

log = logging.getLogger("bench_routing")

LAYOUTS = {"one": {"unified": 1}, "unified4": {"unified": 4},
           "pd2x2": {"prefill": 2, "decode": 2}}
ROUTINGS = ("random", "load", "kv")
FIELDS = ("prefix_cache_hit_rate", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
          "request_goodput", "completed")


def start_stack(layout: str, routing: str, args) -> Stack:
    counts = LAYOUTS[layout]
    stack = Stack(UpOptions(
        host="127.0.0.1", port=free_port(), num_prefill=counts.get("prefill", 0),
        num_decode=counts.get("decode", 0), num_unified=counts.get("unified", 0),
        redis_url=None, worker_args=["--num-threads", str(args.threads),
                                     *shlex.split(args.engine_args)],
        gateway_args=["--http-port", "0", "--routing", routing,
                      *shlex.split(args.gateway_args)], ready_timeout_s=900))
    try:
        stack.start()
        stack.wait_ready()
    except BaseException:
        stack.stop()
        raise
    return stack


def serve_argv(args, address: str, label: str, out: Path) -> list[str]:
    return ["--target", f"grpc://{address}", "--dataset", "prefix",
            "--num-prompts", str(args.num_prompts), "--num-prefixes", str(args.num_prefixes),
            "--prefix-len", str(args.prefix_len), "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--request-rate", "inf",
            "--max-concurrency", str(args.max_concurrency), "--num-warmups", "0",
            "--seed", str(args.seed), "--percentiles", "50,99", "--goodput", *args.goodput,
            "--time-limit", str(args.time_limit), "--disable-progress", "--label", label,
            "--result-dir", str(out), "--result-name", label]


def run_pair(args, layout: str, routing: str, label: str, out: Path) -> dict:
    t0 = time.perf_counter()
    stack = start_stack(layout, routing, args)
    log.info("%s ready in %.1f s", label, time.perf_counter() - t0)
    try:
        if serve.main(serve_argv(args, stack.address, label, out)) != 0:
            raise RuntimeError(f"{label}: bench serve failed")
    finally:
        stack.stop()
    return json.loads((out / f"{label}.json").read_text())


def pairs(layouts: list[str], routings: list[str]) -> list[tuple[str, str]]:
    """(layout, routing) runs of one round: ``one`` once (routing is moot with one worker)."""
    return [(lay, r) for lay in layouts for r in (["kv"] if lay == "one" else routings)]


def summarise(results: dict[str, list[dict]]) -> dict[str, dict]:
    """Per (layout, routing): the median over rounds of each field, and the hit rate's ratio to
    ``one``'s (the ideal) when ``one`` ran."""
    rows = {key: {f: statistics.median(r[f] for r in runs) for f in FIELDS}
            for key, runs in results.items()}
    ideal = rows.get("one/kv", {}).get("prefix_cache_hit_rate")
    for row in rows.values():
        row["hit_rate_vs_one"] = row["prefix_cache_hit_rate"] / ideal if ideal else None
    return rows


def print_table(rows: dict[str, dict]) -> None:
    heads = ("hit rate", "vs one", "TTFT p50 ms", "TTFT p99 ms", "TPOT ms", "goodput/s", "done")
    print("\n" + f"{'layout/routing':<18}" + "".join(f"{h:>13}" for h in heads))
    for key, row in rows.items():
        cells = (row["prefix_cache_hit_rate"], row["hit_rate_vs_one"], row["median_ttft_ms"],
                 row["p99_ttft_ms"], row["mean_tpot_ms"], row["request_goodput"], row["completed"])
        print(f"{key:<18}" + "".join(f"{'-' if v is None else round(v, 3):>13}" for v in cells))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="one,unified4,pd2x2", help=f"of: {', '.join(LAYOUTS)}")
    p.add_argument("--routing", default=",".join(ROUTINGS), help=f"of: {', '.join(ROUTINGS)}")
    p.add_argument("--rounds", type=int, default=1, help="repeat every pair, interleaved")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--num-prefixes", type=int, default=8, help="shared documents")
    p.add_argument("--prefix-len", type=int, default=1024, help="tokens per document")
    p.add_argument("--input-len", type=int, default=32, help="tokens per question")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--engine-args", default="", help="every worker's flags")
    p.add_argument("--gateway-args", default="", help="the gateway's flags (e.g. the weight)")
    p.add_argument("--goodput", nargs="+", default=["ttft:1000", "tpot:200"], metavar="NAME:MS")
    p.add_argument("--time-limit", type=float, default=1200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", default="bench-results/routing")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    layouts = [x for x in args.layouts.split(",") if x]
    routings = [x for x in args.routing.split(",") if x]
    if bad := [x for x in layouts if x not in LAYOUTS] + [x for x in routings if x not in ROUTINGS]:
        parser.error(f"unknown layouts or routings: {bad}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.result_dir)
    results: dict[str, list[dict]] = {}
    for n in range(args.rounds):
        for layout, routing in pairs(layouts, routings):
            key = f"{layout}/{routing}"
            results.setdefault(key, []).append(
                run_pair(args, layout, routing, f"{layout}-{routing}-r{n}", out))
    rows = summarise(results)
    print_table(rows)
    summary = {"config": vars(args), "rows": rows}
    (out / "routing.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out / 'routing.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
