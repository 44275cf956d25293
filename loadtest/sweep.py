"""``tandem bench sweep`` (``python -m loadtest.sweep``): ``bench serve`` at a list of request
rates (or concurrency caps) on the same seeded dataset, and the highest load that keeps SLO
attainment at or above ``--attainment-target`` (0.9 by default).

    python -m loadtest.sweep --target grpc://127.0.0.1:50051 --request-rates 0.5,1,2,4 \\
        --dataset chat --num-prompts 60 --goodput ttft:1000 tpot:200 --result-dir bench-results/sweep

"Sustainable" is the highest load before the first one that misses the target, scanning
upwards (a lucky pass above a failure does not count). Writes one result JSON per point,
``sweep.json`` (the curve and the answer) and ``sweep.png`` into ``--result-dir``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from loadtest.datasets import build_dataset
from loadtest.metrics import parse_goodput
from loadtest.report import plots_available
from loadtest.runner import rate_label
from loadtest.serve import (add_load_args, dataset_options, load_tokenizer, parse_percentiles,
                            run_config, run_one)

CURVE_FIELDS = ("request_rate", "max_concurrency", "completed", "failed", "request_throughput",
                "request_goodput", "output_throughput", "slo_attainment", "p99_ttft_ms",
                "mean_tpot_ms", "p99_itl_ms")


def _numbers(text: str, field: str, cast) -> list:
    try:
        values = sorted(cast(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{field} must be comma-separated numbers, got {text!r}") from None
    if not values or not all(v > 0 for v in values):
        raise ValueError(f"{field} must be > 0, got {text!r}")
    return values


def sustainable(points: list[dict], x_field: str, target: float) -> float | None:
    """The highest ``x_field`` of ``points`` (sorted ascending by it) before the first point
    whose ``slo_attainment`` is below ``target``; None when the lowest already misses."""
    best = None
    for point in points:
        if point["slo_attainment"] < target:
            break
        best = point[x_field]
    return best


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep = p.add_mutually_exclusive_group(required=True)
    sweep.add_argument("--request-rates", help="comma-separated requests/s, one run each")
    sweep.add_argument("--max-concurrencies", help="comma-separated caps, one run each "
                       "(at --request-rate, default inf)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="with --max-concurrencies")
    p.add_argument("--attainment-target", type=float, default=0.9, help="fraction in (0, 1]")
    add_load_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        parse_goodput(args.goodput), parse_percentiles(args.percentiles)
        if not 0 < args.attainment_target <= 1:
            raise ValueError(f"attainment_target must be in (0, 1], got {args.attainment_target}")
        if args.request_rates:
            x_field, loads = "request_rate", [(r, None) for r in _numbers(args.request_rates, "request_rates", float)]
        else:
            x_field = "max_concurrency"
            loads = [(args.request_rate, c) for c in _numbers(args.max_concurrencies, "max_concurrencies", int)]
        for rate, conc in loads:
            run_config(args, rate, conc)
        opts = dataset_options(args)  # checked before the (slow) tokenizer load
        requests = build_dataset(args.dataset, args.num_prompts, load_tokenizer(args.tokenizer), opts)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    plots_available()
    results = []
    for rate, conc in loads:
        name = f"sweep-rate-{rate_label(rate)}" + (f"-conc-{conc}" if conc else "")
        try:
            results.append(run_one(args, requests, rate, conc, name))
        except ConnectionError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    report = summarize_sweep(results, x_field, args.attainment_target)
    out = Path(args.result_dir)
    (out / "sweep.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'sweep.json'}")
    _plot_curve(results, args.label or args.target, out / "sweep.png", x_field)
    print(f"highest {x_field.replace('_', ' ')} with SLO attainment >= {args.attainment_target:g}: "
          f"{report['sustainable']}")
    return 0


def _plot_curve(results: list[dict], label: str, path: Path, x_field: str) -> None:
    try:
        from loadtest import plot
    except ImportError:  # matplotlib is the optional `bench` extra
        return  # said at the start (plots_available)
    plot.rate_curves({label: results}, path, x_field)
    print(f"wrote {path}")


def summarize_sweep(results: list[dict], x_field: str, target: float) -> dict:
    """``{"x", "attainment_target", "sustainable", "points": [...]}`` (see ``sustainable``)."""
    points = [{k: r.get(k) for k in CURVE_FIELDS} for r in results]
    points.sort(key=lambda p: float(p[x_field]))
    return {"x": x_field, "attainment_target": target,
            "sustainable": sustainable(points, x_field, target), "points": points}


if __name__ == "__main__":
    raise SystemExit(main())
