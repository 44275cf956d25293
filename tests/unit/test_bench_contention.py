"""scripts/bench_contention.py's arithmetic: rows grouped per (server, scenario, concurrency),
averaged over rounds, each compared with the same server's quiet figure."""
from __future__ import annotations

from scripts.bench_contention import FIGURES, build_parser, summarise


def row(server, scenario, c, tok_s, tpot, r=0):
    figures = dict.fromkeys(FIGURES, 0.0)
    figures.update(output_throughput=tok_s, median_tpot_ms=tpot)
    return {"server": server, "scenario": scenario, "concurrency": c, "round": r, **figures}


def test_summary_averages_rounds_and_compares_with_quiet():
    rows = [row("tandem", "busy0", 16, 600, 20, 0), row("tandem", "busy0", 16, 400, 30, 1),
            row("tandem", "busy1", 16, 250, 50), row("peer", "busy0", 16, 200, 80),
            row("peer", "busy1", 16, 50, 320), row("tandem", "quota1", 16, 300, 40)]
    table = {(t["server"], t["scenario"]): t for t in summarise(rows)}
    assert table["tandem", "busy0"]["output_throughput"] == 500 and table["tandem", "busy0"]["runs"] == 2
    assert table["tandem", "busy1"]["tok_s_of_quiet"] == 0.5 and table["tandem", "busy1"]["tpot_of_quiet"] == 2.0
    assert table["peer", "busy1"]["tok_s_of_quiet"] == 0.25 and table["peer", "busy1"]["tpot_of_quiet"] == 4.0
    assert table["tandem", "quota1"]["tok_s_of_quiet"] == 0.6


def test_defaults_are_the_issue_s_scenarios():
    args = build_parser().parse_args([])
    assert args.concurrency == [1, 16] and args.neighbours == [0, 1] and args.quota == 0.0
