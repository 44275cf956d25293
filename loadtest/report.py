"""The result of one ``bench serve`` run: the JSON (``vllm bench serve``'s field names plus ours),
its PNG figures, and the summary table printed to the terminal."""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from loadtest.metrics import by_kind, detail_arrays, summarize
from loadtest.runner import RunOutcome


def build_result(outcome: RunOutcome, run_info: dict, slos: dict[str, float],
                 percentiles: list[float], save_detailed: bool) -> dict:
    """The result dict: ``run_info`` (how the run was configured), ``summarize``'s figures,
    ``by_kind`` figures, ``not_sent``, ``server_view``; with ``save_detailed`` also the
    per-request arrays (``input_lens``, ``output_lens``, ``ttfts``, ``tpots``, ``itls``,
    ``e2els``, ``errors``, seconds) and ``requests`` (every record)."""
    records = outcome.records
    result = {"date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"), **run_info}
    if outcome.model:
        result["model_id"] = outcome.model
    result.update(summarize(records, outcome.duration_s, slos, percentiles))
    result["not_sent"] = outcome.not_sent
    result["failed_requests"] = [{"index": r.index, "request_id": r.request_id, "error": r.error}
                                 for r in records if not r.success]
    kinds = {r.kind for r in records}
    if len(kinds) > 1:
        result["by_kind"] = by_kind(records, outcome.duration_s, slos, percentiles)
    result["server_view"] = outcome.server_view
    if save_detailed:
        result.update(detail_arrays(records))
        result["input_lens"] = [r.prompt_len for r in records if r.success]
        result["output_lens"] = [r.output_tokens for r in records if r.success]
        result["errors"] = [r.error for r in records]
        result["requests"] = [asdict(r) for r in records]
    return result


NO_PLOTS = "no PNG plots: matplotlib is missing (pip install 'tandem[bench]'); the JSON is written"


def plots_available() -> bool:
    """Whether matplotlib (the optional ``bench`` extra) is installed; when not, says so on
    stderr at once, before a run that may take minutes."""
    import importlib.util
    if importlib.util.find_spec("matplotlib") is not None:
        return True
    print(NO_PLOTS, file=sys.stderr)
    return False


def write_result(result: dict, outcome: RunOutcome, result_dir: Path, name: str) -> list[Path]:
    """Write ``name``.json and its PNGs (``name``-latency_cdf.png, -timeline.png,
    -throughput.png; only when matplotlib is installed) into ``result_dir``; returns the paths
    written."""
    result_dir.mkdir(parents=True, exist_ok=True)
    json_path = result_dir / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=2, allow_nan=False, default=_jsonable))
    try:
        from loadtest import plot
    except ImportError:  # matplotlib is the optional `bench` extra
        print(NO_PLOTS, file=sys.stderr)
        return [json_path]
    pngs = [result_dir / f"{name}-{kind}.png" for kind in ("latency_cdf", "timeline", "throughput")]
    plot.latency_cdfs([(name, detail_arrays(outcome.records))], pngs[0])
    plot.timeline(outcome.records, pngs[1])
    plot.throughput_timeline(outcome.records, outcome.duration_s, pngs[2])
    return [json_path, *pngs]


def _jsonable(value):
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def json_number(value: float) -> float | str:
    """``inf`` as the string "inf" (as vLLM writes an unbounded request rate); else the value."""
    return "inf" if math.isinf(value) else value


def print_summary(result: dict, percentiles: list[float]) -> None:
    """The summary table, in the layout of vLLM's serving benchmark."""
    rows = [("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
            ("Not sent (time limit)", result["not_sent"]),
            ("Benchmark duration (s)", result["duration"]),
            ("Total input tokens", result["total_input_tokens"]),
            ("Total generated tokens", result["total_output_tokens"]),
            ("Prefix cache hit rate (cached / input)", result["prefix_cache_hit_rate"]),
            ("Request throughput (req/s)", result["request_throughput"]),
            ("Request goodput (req/s)", result["request_goodput"]),
            ("SLO attainment", result["slo_attainment"]),
            ("Output token throughput (tok/s)", result["output_throughput"]),
            ("Total token throughput (tok/s)", result["total_token_throughput"])]
    print("{s:{c}^60}".format(s=" Serving Benchmark Result ", c="="))
    for label, value in rows:
        print(f"{label:<44}{value:>16.2f}" if isinstance(value, float) else f"{label:<44}{value:>16}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat in ("mean", "median", "std", *(f"p{p:g}" for p in percentiles)):
            print(f"{stat.capitalize() + ' ' + name.upper() + ' (ms)':<44}{result[f'{stat}_{name}_ms']:>16.2f}")
    top = f"p{percentiles[-1]:g}"  # the highest percentile asked for
    for kind, figures in result.get("by_kind", {}).items():
        print(f"{kind:>8}: {figures['completed']} done, TTFT {top} {figures[f'{top}_ttft_ms']:.0f} ms, "
              f"TPOT mean {figures['mean_tpot_ms']:.1f} ms, ITL {top} {figures[f'{top}_itl_ms']:.1f} ms, "
              f"goodput {figures['request_goodput']:.2f} req/s")
    for error, count in result.get("errors_by_message", {}).items():
        print(f"failed x{count}: {error}")
    print("=" * 60)
