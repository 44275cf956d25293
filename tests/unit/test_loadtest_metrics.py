"""bench serve's figures on hand-made latency sets: percentiles, TPOT, goodput (DistServe) and
SLO attainment, and vLLM's result field names."""
from __future__ import annotations

import pytest

from loadtest.metrics import (RequestRecord, distribution, max_concurrency_seen, meets_slos,
                              parse_goodput, summarize)


def rec(i: int, sent: float, ttft: float, e2el: float, out: int, itl=(), ok=True, kind="chat",
        prompt=10, error="") -> RequestRecord:
    return RequestRecord(i, kind, f"r{i}", sent_s=sent, first_token_s=sent + ttft,
                         finish_s=sent + e2el, prompt_len=prompt, output_tokens=out,
                         itl=list(itl), success=ok, error=error)


def test_tpot_is_latency_after_the_first_token_over_output_len_minus_one():
    assert rec(0, 1.0, 0.2, 1.2, 11).tpot == pytest.approx(0.1)
    assert rec(0, 0.0, 0.2, 0.2, 1).tpot is None


def test_distribution_uses_linear_interpolation_and_population_std():
    d = distribution([0.001, 0.002, 0.003, 0.004, 0.010], [50, 90, 99], "ttft")
    assert d["mean_ttft_ms"] == pytest.approx(4.0)
    assert d["median_ttft_ms"] == pytest.approx(3.0)
    assert d["p50_ttft_ms"] == pytest.approx(3.0)
    assert d["p90_ttft_ms"] == pytest.approx(7.6)    # 4 + 0.6 * (10 - 4)
    assert d["p99_ttft_ms"] == pytest.approx(9.76)   # 4 + 0.96 * (10 - 4)
    assert d["std_ttft_ms"] == pytest.approx(3.1622776)  # population std of 1,2,3,4,10


def test_goodput_counts_requests_meeting_every_slo_per_second():
    records = [
        rec(0, 0.0, 0.1, 1.1, 11),              # ttft 100 ms, tpot 100 ms: good
        rec(1, 0.0, 0.3, 1.3, 11),              # ttft 300 ms: misses ttft
        rec(2, 0.0, 0.1, 2.1, 11),              # tpot 200 ms: misses tpot
        rec(3, 0.0, 0.2, 0.2, 1),               # one token: tpot counts as 0; ttft 200: good
        rec(4, 0.0, 0.0, 0.0, 0, ok=False, error="UNAVAILABLE: gone"),  # failed: never good
    ]
    slos = parse_goodput(["ttft:200", "tpot:150"])
    assert [meets_slos(r, slos) for r in records] == [True, False, False, True, False]
    result = summarize(records, duration_s=2.0, slos=slos, percentiles=[99])
    assert result["request_goodput"] == pytest.approx(1.0)   # 2 good / 2 s
    assert result["slo_attainment"] == pytest.approx(0.4)    # 2 of 5 sent
    assert result["completed"] == 4 and result["failed"] == 1
    assert result["request_throughput"] == pytest.approx(2.0)
    assert result["errors_by_message"] == {"UNAVAILABLE: gone": 1}


def test_an_e2el_slo_and_an_slo_nobody_meets():
    records = [rec(0, 0.0, 0.1, 1.1, 11), rec(1, 0.0, 0.1, 3.1, 11)]
    assert summarize(records, 4.0, parse_goodput(["e2el:2000"]), [99])["request_goodput"] == 0.25
    nobody = summarize(records, 4.0, parse_goodput(["ttft:0.001"]), [99])
    assert nobody["request_goodput"] == 0.0 and nobody["slo_attainment"] == 0.0


def test_summary_has_vllm_field_names_and_token_totals():
    records = [rec(0, 0.0, 0.1, 0.5, 5, itl=[0.1] * 4, prompt=7),
               rec(1, 0.2, 0.1, 0.7, 7, itl=[0.1] * 6, prompt=9)]
    result = summarize(records, 1.0, {}, [90, 99])
    for key in ("completed", "failed", "duration", "request_throughput", "request_goodput",
                "output_throughput", "total_token_throughput", "total_input_tokens",
                "total_output_tokens"):
        assert key in result
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in result
    assert result["total_input_tokens"] == 16 and result["total_output_tokens"] == 12
    assert result["output_throughput"] == 12.0 and result["total_token_throughput"] == 28.0
    assert result["mean_itl_ms"] == pytest.approx(100.0)
    assert result["request_goodput"] == result["request_throughput"]  # no SLO: all completed


def test_max_concurrency_seen_counts_overlapping_requests():
    records = [rec(0, 0.0, 0.1, 1.0, 2), rec(1, 0.5, 0.1, 1.0, 2), rec(2, 1.0, 0.1, 1.0, 2),
               rec(3, 3.0, 0.1, 1.0, 2)]
    assert max_concurrency_seen(records) == 2  # the third starts as the first ends


@pytest.mark.parametrize("items", [["ttft"], ["speed:10"], ["ttft:abc"], ["tpot:0"], ["e2el:-5"]])
def test_bad_goodput_items_name_the_field(items):
    with pytest.raises(ValueError, match="^goodput"):
        parse_goodput(items)


def test_summary_refuses_a_non_positive_duration():
    with pytest.raises(ValueError, match="^duration"):
        summarize([], 0.0, {}, [99])
