"""What disaggregation buys on one machine: a steady chat load plus a stream of long prompts,
served by each layout (and by any OpenAI-compatible peer) in one run with the same client.

    python -m scripts.bench_interference --request-rate 0.5 --num-prompts 60 \\
        --options disagg-1t,unified --peer llama.cpp=http://127.0.0.1:18080/v1 \\
        --goodput ttft:1000 tpot:200 --result-dir bench-results/interference

Workload: ``tandem bench serve``'s ``long-mix`` dataset (the built-in chat prompts, outputs up
to ``--chat-max-tokens``; with probability ``--long-fraction`` a random prompt of
``--long-input-range`` tokens with ``--long-output-len`` exact output tokens), Poisson arrivals
at ``--request-rate``, fixed seed, over HTTP ``/v1/chat/completions`` for every target (so
Tandem and the peer see the same requests through the same client and chat templates).

Each option (``scripts.bench_layout``'s names: ``disagg-1t`` is one prefill and one decode
worker, one thread each; ``unified`` one worker that prefills and decodes on every core) is a
fresh stack, loaded once. The interference (DistServe, Zhong et al. 2024, section 2: a long
prefill colocated with decoding stalls the running decode streams) shows in the chat streams'
TPOT and ITL p99, the price of separating it in the long prompts' TTFT. Prints a table and
writes ``interference.json`` plus each run's ``bench serve`` JSON (``--save-detailed``) and
PNGs and an overlay of all runs' latency CDFs (``latency_cdf.png``). The machine must be quiet;
compare figures only within one run.
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
import time
from pathlib import Path

from loadtest import plot, serve
from scripts.bench_layout import OPTIONS, free_port, start_stack
from services.runtime.layout import usable_cores

log = logging.getLogger("bench_interference")

ROW = (("chat", "completed"), ("chat", "mean_tpot_ms"), ("chat", "p99_tpot_ms"),
       ("chat", "p99_itl_ms"), ("chat", "slo_attainment"), ("long", "completed"),
       ("long", "median_ttft_ms"), ("long", "p90_ttft_ms"), ("all", "request_goodput"),
       ("all", "slo_attainment"), ("all", "output_throughput"))


def serve_argv(args, target: str, label: str, out: Path) -> list[str]:
    lo, hi = args.long_input_range
    return ["--target", target, "--endpoint", "chat", "--request-rate", str(args.request_rate),
            "--num-prompts", str(args.num_prompts), "--dataset", "long-mix",
            "--long-fraction", str(args.long_fraction), "--long-input-range", f"{lo}:{hi}",
            "--long-output-len", str(args.long_output_len),
            "--chat-max-tokens", str(args.chat_max_tokens), "--num-warmups", "2",
            "--seed", str(args.seed), "--percentiles", "50,90,99",
            "--time-limit", str(args.time_limit), "--goodput", *args.goodput,
            "--save-detailed", "--disable-progress", "--label", label,
            "--result-dir", str(out), "--result-name", label]


def run_target(args, target: str, label: str, out: Path) -> dict:
    if serve.main(serve_argv(args, target, label, out)) != 0:
        raise RuntimeError(f"{label}: bench serve failed")
    return json.loads((out / f"{label}.json").read_text())


def run_option(args, name: str, out: Path) -> dict:
    """A fresh stack of layout ``name`` (HTTP on a free port), loaded once, then stopped."""
    t0 = time.perf_counter()
    http_port = free_port()
    stack = start_stack(OPTIONS[name], usable_cores(), shlex.split(args.engine_args), free_port(),
                        http_port=http_port)
    log.info("%s ready in %.1f s", name, time.perf_counter() - t0)
    try:
        return run_target(args, f"http://127.0.0.1:{http_port}/v1", name, out)
    finally:
        stack.stop()


def figures(result: dict) -> dict:
    """The study's figures of one run: ``{(kind, field): value}`` flattened to "kind.field"."""
    kinds = dict(result.get("by_kind", {}), all=result)
    return {f"{kind}.{field}": kinds.get(kind, {}).get(field) for kind, field in ROW}


def print_table(rows: dict[str, dict]) -> None:
    heads = [f"{k}.{f}".replace("_ms", "").replace("median", "p50") for k, f in ROW]
    print("\n" + f"{'target':<12}" + "".join(f"{h:>22}" for h in heads))
    for label, row in rows.items():
        cells = [row[f"{k}.{f}"] for k, f in ROW]
        print(f"{label:<12}" + "".join(f"{'-' if v is None else round(v, 3):>22}" for v in cells))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_interference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--options", default="disagg-1t,unified", help=f"of: {', '.join(OPTIONS)}")
    p.add_argument("--peer", action="append", default=[], metavar="LABEL=URL",
                   help="an OpenAI-compatible server already running (repeatable)")
    p.add_argument("--request-rate", type=float, default=0.5, help="requests/s (Poisson)")
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--long-fraction", type=float, default=0.2)
    p.add_argument("--long-input-range", type=serve._range, default=(1536, 4096), help="LO:HI")
    p.add_argument("--long-output-len", type=int, default=16)
    p.add_argument("--chat-max-tokens", type=int, default=128)
    p.add_argument("--goodput", nargs="+", default=["ttft:1000", "tpot:200"], metavar="NAME:MS")
    p.add_argument("--engine-args", default="", help="worker flags of every option")
    p.add_argument("--time-limit", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", default="bench-results/interference")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    names = [n for n in args.options.split(",") if n]
    peers = [tuple(p.split("=", 1)) for p in args.peer]
    if unknown := [n for n in names if n not in OPTIONS]:
        parser.error(f"--options: unknown {unknown}; known: {', '.join(OPTIONS)}")
    if bad := [p for p in peers if len(p) != 2 or not p[1].startswith("http")]:
        parser.error(f"--peer: expected LABEL=http://HOST:PORT/v1, got {bad}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.result_dir)
    results = {name: run_option(args, name, out) for name in names}
    results.update({label: run_target(args, url, label, out) for label, url in peers})
    rows = {label: figures(r) for label, r in results.items()}
    print_table(rows)
    plot.main([str(out / f"{label}.json") for label in results] + ["--out", str(out)])
    summary = {"config": {k: v for k, v in vars(args).items()}, "usable_cores": usable_cores(),
               "figures": rows}
    (out / "interference.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out / 'interference.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
