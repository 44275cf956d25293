"""scripts.bench_interference: its bench-serve arguments parse, and its figures pick the
chat streams' and the long prompts' values out of a result's ``by_kind``."""
from __future__ import annotations

from pathlib import Path

import pytest

from loadtest import serve
from scripts import bench_interference as bi


def test_serve_argv_is_a_long_mix_chat_run_serve_accepts():
    args = bi.build_parser().parse_args(["--request-rate", "0.75", "--long-input-range", "100:200",
                                         "--goodput", "ttft:5000", "tpot:250"])
    ns = serve.build_parser().parse_args(bi.serve_argv(args, "http://h:1/v1", "unified", Path("d")))
    assert (ns.target, ns.endpoint, ns.dataset) == ("http://h:1/v1", "chat", "long-mix")
    assert ns.request_rate == 0.75 and ns.long_input_range == (100, 200)
    assert ns.goodput == ["ttft:5000", "tpot:250"] and ns.save_detailed
    assert (ns.label, ns.result_name, ns.result_dir) == ("unified", "unified", "d")


def test_figures_take_each_kind_and_the_whole_run():
    result = {"request_goodput": 0.4, "slo_attainment": 0.8, "output_throughput": 12.0,
              "by_kind": {"chat": {"completed": 7, "mean_tpot_ms": 90.0, "p99_itl_ms": 300.0},
                          "long": {"completed": 2, "median_ttft_ms": 4000.0}}}
    row = bi.figures(result)
    assert row["chat.completed"] == 7 and row["chat.p99_itl_ms"] == 300.0
    assert row["long.median_ttft_ms"] == 4000.0 and row["long.p90_ttft_ms"] is None
    assert row["all.request_goodput"] == 0.4 and row["all.output_throughput"] == 12.0


@pytest.mark.parametrize("argv, field", [(["--options", "nope"], "--options"),
                                         (["--peer", "llama"], "--peer")])
def test_bad_arguments_name_the_flag(argv, field, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bi.main(argv)
    assert exit_info.value.code == 2 and field in capsys.readouterr().err
