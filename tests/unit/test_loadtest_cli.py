"""bench serve / sweep command lines: bad values stop before any request with exit status 2 and a
message naming the field."""
from __future__ import annotations

import pytest

from loadtest import serve, sweep

TARGET = ["--target", "grpc://127.0.0.1:1"]


@pytest.mark.parametrize("argv, field", [
    (["--goodput", "speed:10"], "goodput"),
    (["--percentiles", "0,200"], "percentiles"),
    (["--request-rate", "0"], "request_rate"),
    (["--burstiness", "-1"], "burstiness"),
    (["--max-concurrency", "0"], "max_concurrency"),
    (["--random-range-ratio", "2"], "range_ratio"),
])
def test_bad_serve_flags_exit_2_naming_the_field(capsys, argv, field):
    with pytest.raises(SystemExit) as exit_:
        serve.main(TARGET + argv)
    assert exit_.value.code == 2
    assert f"error: {field}" in capsys.readouterr().err


def test_a_bad_target_exits_2_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        serve.main(["--target", "localhost:50051"])
    assert exit_.value.code == 2 and "error: target" in capsys.readouterr().err


@pytest.mark.parametrize("argv, field", [
    (["--request-rates", "1,x"], "request_rates"),
    (["--max-concurrencies", "0,2"], "max_concurrencies"),
    (["--request-rates", "1", "--attainment-target", "1.5"], "attainment_target"),
])
def test_bad_sweep_flags_exit_2_naming_the_field(capsys, argv, field):
    with pytest.raises(SystemExit) as exit_:
        sweep.main(TARGET + argv)
    assert exit_.value.code == 2 and f"error: {field}" in capsys.readouterr().err
