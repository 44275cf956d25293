"""bench sweep's answer (the highest load before attainment first drops under the target), and
the figures of a run and of an overlay being real PNG files."""
from __future__ import annotations

import json

import pytest

from loadtest import plot
from loadtest.metrics import RequestRecord, detail_arrays, summarize
from loadtest.sweep import summarize_sweep, sustainable

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def point(rate, attainment):
    return {"request_rate": rate, "slo_attainment": attainment}


@pytest.mark.parametrize("points, best", [
    ([point(0.5, 1.0), point(1, 0.95), point(2, 0.6), point(4, 0.1)], 1),
    ([point(0.5, 1.0), point(1, 0.85), point(2, 0.95)], 0.5),  # a lucky pass above a miss
    ([point(0.5, 0.5), point(1, 0.2)], None),
    ([point(0.5, 0.9), point(1, 0.9)], 1),                       # the target itself passes
])
def test_sustainable_is_the_highest_load_before_the_first_miss(points, best):
    assert sustainable(points, "request_rate", 0.9) == best


def test_summarize_sweep_sorts_points_and_reports_the_answer():
    results = [dict(point(2, 0.5), completed=3), dict(point(1, 1.0), completed=4)]
    report = summarize_sweep(results, "request_rate", 0.9)
    assert [p["request_rate"] for p in report["points"]] == [1, 2]
    assert report["sustainable"] == 1 and report["attainment_target"] == 0.9


def _records():
    return [RequestRecord(i, "chat", f"r{i}", scheduled_s=0.3 * i, sent_s=0.3 * i,
                          first_token_s=0.3 * i + 0.1, finish_s=0.3 * i + 0.5, prompt_len=5,
                          output_tokens=5, itl=[0.1] * 4, success=i != 2, error="x" * (i == 2))
            for i in range(6)]


def test_run_and_overlay_figures_are_png_files(tmp_path):
    records = _records()
    plot.latency_cdfs([("a", detail_arrays(records))], tmp_path / "cdf.png")
    plot.timeline(records, tmp_path / "timeline.png")
    plot.throughput_timeline(records, 2.1, tmp_path / "tput.png")
    files = []
    for rate in (1, 2):
        result = {**summarize(records, 2.1, {"ttft": 200.0}, [99]), "request_rate": rate,
                  "label": "tandem", **detail_arrays(records)}
        files.append(tmp_path / f"r{rate}.json")
        files[-1].write_text(json.dumps(result))
    assert plot.main([str(f) for f in files] + ["--out", str(tmp_path / "overlay")]) == 0
    for name in ("cdf.png", "timeline.png", "tput.png", "overlay/rate_curves.png",
                 "overlay/latency_cdf.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000, name


def test_summary_table_prints_every_figure_and_each_kind(capsys):
    from loadtest.metrics import by_kind
    from loadtest.report import print_summary

    records = _records()
    records[0].kind = "long"
    result = {**summarize(records, 2.1, {}, [50, 95]), "not_sent": 0,
              "by_kind": by_kind(records, 2.1, {}, [50, 95])}
    print_summary(result, [50, 95])
    out = capsys.readouterr().out
    for line in ("Successful requests", "Request goodput (req/s)", "P95 TTFT (ms)", "Median ITL (ms)",
                 "P50 E2EL (ms)", "failed x1: x"):
        assert line in out, line
    assert "    long: 1 done, TTFT p95 100 ms" in out and "    chat: 4 done" in out
