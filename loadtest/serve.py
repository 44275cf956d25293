"""``tandem bench serve`` (``python -m loadtest.serve``): load a serving stack at a request rate
and report TTFT, TPOT, ITL, end-to-end latency, throughput and SLO goodput.

    python -m loadtest.serve --target grpc://127.0.0.1:50051 --request-rate 2 --num-prompts 100 \\
        --dataset chat --goodput ttft:1000 tpot:200 --result-dir bench-results/serve

Targets: the Tandem gateway over gRPC, or any OpenAI-compatible server (``http://HOST:PORT/v1``,
``--endpoint chat|completions``). Writes ``NAME.json`` (vLLM's field names) and PNG plots into
``--result-dir`` and prints a summary table. Exit status 0 when the run completed (even with
failed requests: they are part of the result), 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from loadtest.arrivals import RAMPS, ArrivalSchedule
from loadtest.datasets import DATASETS, DatasetOptions, build_dataset
from loadtest.metrics import parse_goodput
from loadtest.report import (build_result, json_number, plots_available, print_summary,
                             write_result)
from loadtest.runner import RunConfig, rate_label, run_load


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def add_load_args(p: argparse.ArgumentParser) -> None:
    """Target, load shape and dataset flags (shared with ``loadtest.sweep``)."""
    t = p.add_argument_group("target")
    t.add_argument("--target", required=True, help="grpc://HOST:PORT or http://HOST:PORT/v1")
    t.add_argument("--api-key", default="", help="sent as 'Authorization: Bearer K' (HTTP)")
    t.add_argument("--endpoint", default="chat", choices=["chat", "completions"], help="HTTP API")
    t.add_argument("--model", default="", help="HTTP: model name (default: the first of /models)")
    t.add_argument("--redis-url", default="", help="Tandem's Redis: sample the workers' load")
    t.add_argument("--server-poll-s", type=float, default=0.5)
    t.add_argument("--tokenizer", default="", help="GGUF file or HF folder (default: built-in model)")
    s = p.add_argument_group("load shape")
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of gaps; 1 = Poisson")
    s.add_argument("--ramp-up", default="none", choices=RAMPS)
    s.add_argument("--ramp-up-start-rate", type=float, default=1.0, help="requests/s at the start")
    s.add_argument("--num-prompts", type=int, default=100)
    s.add_argument("--num-warmups", type=int, default=1, help="requests before the run, not counted")
    s.add_argument("--time-limit", type=float, default=600.0, help="seconds; nothing sent after")
    s.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--client-processes", type=int, default=1,
                   help="processes sending the requests, each with its own connections and a "
                        "share of --max-concurrency (one relays about as many tokens/s as one "
                        "gateway process)")
    s.add_argument("--grpc-channels", type=int, default=1,
                   help="gRPC connections of each client process, requests taking them in turn "
                        "(one channel reaches one of the gateways sharing a port)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", default="chat", choices=DATASETS)
    d.add_argument("--random-input-len", type=int, default=128)
    d.add_argument("--random-output-len", type=int, default=64)
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--prefix-len", type=int, default=256)
    d.add_argument("--num-prefixes", type=int, default=4, help="prefix: shared documents")
    d.add_argument("--num-turns", type=int, default=4, help="multiturn: turns per conversation")
    d.add_argument("--sharegpt-path", default="")
    d.add_argument("--sharegpt-output-len", type=int, default=0)
    d.add_argument("--chat-max-tokens", type=int, default=128)
    d.add_argument("--long-fraction", type=float, default=0.2)
    d.add_argument("--long-input-range", type=_range, default=(1536, 4096), help="LO:HI tokens")
    d.add_argument("--long-output-len", type=int, default=16)
    r = p.add_argument_group("report")
    r.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs: ttft:MS tpot:MS e2el:MS")
    r.add_argument("--percentiles", default="90,99", help="comma-separated, e.g. 50,90,99")
    r.add_argument("--result-dir", default="bench-results/serve")
    r.add_argument("--label", default="", help="names this run in overlays (default: the target)")
    r.add_argument("--save-detailed", action="store_true", help="keep per-request records")
    r.add_argument("--disable-progress", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--result-name", default="", help="file name stem (default: serve-rate-R)")
    add_load_args(p)
    return p


def load_tokenizer(path: str):
    """The tokenizer counting prompt lengths: ``path`` or the built-in model's."""
    from services.engine.model_files import default_model_path
    from services.engine.tokenizer import Tokenizer

    return Tokenizer.load(path or default_model_path())


def dataset_options(args) -> DatasetOptions:
    return DatasetOptions(
        seed=args.seed, input_len=args.random_input_len, output_len=args.random_output_len,
        range_ratio=args.random_range_ratio, prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes, num_turns=args.num_turns, sharegpt_path=args.sharegpt_path,
        sharegpt_output_len=args.sharegpt_output_len, chat_max_tokens=args.chat_max_tokens,
        long_fraction=args.long_fraction, long_input_range=args.long_input_range,
        long_output_len=args.long_output_len)


def run_config(args, rate: float, max_concurrency: int | None) -> RunConfig:
    schedule = ArrivalSchedule(rate, args.burstiness, args.ramp_up, args.ramp_up_start_rate, args.seed)
    return RunConfig(args.target, schedule, max_concurrency, args.num_warmups, args.time_limit,
                     args.request_timeout, args.endpoint, args.model, args.api_key,
                     args.redis_url, args.server_poll_s, not args.disable_progress,
                     args.client_processes, args.grpc_channels)


def run_info(args, cfg: RunConfig) -> dict:
    """How the run was configured, under vLLM's names where it has one."""
    return {"label": args.label or args.target, "backend": "tandem-grpc" if cfg.target.startswith("grpc")
            else f"openai-{args.endpoint}", "target": cfg.target, "dataset": args.dataset,
            "num_prompts": args.num_prompts, "request_rate": json_number(cfg.schedule.rate),
            "burstiness": cfg.schedule.burstiness, "max_concurrency": cfg.max_concurrency,
            "ramp_up_strategy": cfg.schedule.ramp, "ramp_up_start_rate": cfg.schedule.ramp_start_rate,
            "seed": args.seed, "num_warmups": cfg.num_warmups, "tokenizer_id": args.tokenizer or "built-in",
            "client_processes": cfg.client_processes, "grpc_channels": cfg.grpc_channels}


def run_one(args, requests, rate: float, max_concurrency: int | None, name: str) -> dict:
    """One run at ``rate``: send, report, write the JSON and PNGs; returns the result dict."""
    slos = parse_goodput(args.goodput)
    percentiles = parse_percentiles(args.percentiles)
    cfg = run_config(args, rate, max_concurrency)
    outcome = run_load(cfg, requests)
    result = build_result(outcome, run_info(args, cfg), slos, percentiles, args.save_detailed)
    paths = write_result(result, outcome, Path(args.result_dir), name)
    print_summary(result, percentiles)
    print("wrote " + ", ".join(str(p) for p in paths))
    return result


def parse_percentiles(text: str) -> list[float]:
    """``"90,99"`` -> [90.0, 99.0]. Raises ValueError naming ``percentiles`` outside (0, 100]."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"percentiles must be comma-separated numbers, got {text!r}") from None
    if not values or not all(0 < v <= 100 for v in values):
        raise ValueError(f"percentiles must be in (0, 100], got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        parse_goodput(args.goodput), parse_percentiles(args.percentiles)
        run_config(args, args.request_rate, args.max_concurrency)
        opts = dataset_options(args)  # checked before the (slow) tokenizer load
        requests = build_dataset(args.dataset, args.num_prompts, load_tokenizer(args.tokenizer), opts)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    name = args.result_name or f"serve-rate-{rate_label(args.request_rate)}"
    plots_available()
    try:
        run_one(args, requests, args.request_rate, args.max_concurrency, name)
    except ConnectionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
