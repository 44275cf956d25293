"""scripts.bench_routing: its bench-serve arguments parse as a prefix run, one worker runs once
per round, and the summary's hit rates are relative to one worker's (the ideal)."""
from __future__ import annotations

from pathlib import Path

from loadtest import serve
from scripts import bench_routing as br


def test_serve_argv_is_a_prefix_run_serve_accepts():
    args = br.build_parser().parse_args(["--num-prefixes", "8", "--prefix-len", "1000",
                                         "--max-concurrency", "4"])
    ns = serve.build_parser().parse_args(br.serve_argv(args, "127.0.0.1:5", "x", Path("d")))
    assert (ns.target, ns.dataset, ns.num_prefixes, ns.prefix_len) == (
        "grpc://127.0.0.1:5", "prefix", 8, 1000)
    assert ns.max_concurrency == 4 and ns.num_prompts == 48 and ns.result_name == "x"


def test_one_worker_runs_once_per_round_the_pools_once_per_routing():
    assert br.pairs(["one", "unified4"], ["random", "kv"]) == [
        ("one", "kv"), ("unified4", "random"), ("unified4", "kv")]


def test_summary_takes_medians_and_relates_hit_rates_to_one_worker():
    def run(hit, ttft):
        return {"prefix_cache_hit_rate": hit, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
                "mean_tpot_ms": 50.0, "request_goodput": 1.0, "completed": 48}

    rows = br.summarise({"one/kv": [run(0.8, 100)], "unified4/kv": [run(0.7, 90), run(0.76, 80),
                                                                     run(0.74, 85)]})
    assert rows["unified4/kv"]["prefix_cache_hit_rate"] == 0.74
    assert rows["unified4/kv"]["median_ttft_ms"] == 85
    assert abs(rows["unified4/kv"]["hit_rate_vs_one"] - 0.74 / 0.8) < 1e-12
    assert rows["one/kv"]["hit_rate_vs_one"] == 1.0
