"""`tandem up`'s layout (services/layout.py): the auto rule by usable cores, explicit settings
winning over it, contradictions failing naming the setting, and the CLI's --unified."""
from __future__ import annotations

import pytest

from services import cli
from services.layout import WorkerLayout, choose_layout
from services.settings import UpSection
from services.settings_sources import SettingsError, leaves


def layout(cores: int, num_threads: int | None = None, **up) -> WorkerLayout:
    return choose_layout(UpSection(**up), cores, num_threads)


def counts(lay: WorkerLayout) -> tuple[int, int, int]:
    return lay.num_prefill, lay.num_decode, lay.num_unified


@pytest.mark.parametrize("cores,expected,threads", [
    (1, (0, 0, 1), {"unified": 1}),
    (2, (0, 0, 1), {"unified": 2}),
    (4, (0, 0, 1), {"unified": 4}),
    (5, (1, 1, 0), {"prefill": 2, "decode": 2}),
    (16, (1, 1, 0), {"prefill": 8, "decode": 8}),
])
def test_auto_is_one_unified_worker_with_every_core_on_a_small_machine(cores, expected, threads):
    lay = layout(cores)
    assert counts(lay) == expected and lay.threads == threads
    assert lay.reason.startswith("auto:") and str(cores) in lay.reason


def test_auto_threshold_is_a_setting():
    assert counts(layout(2, auto_unified_max_cores=1)) == (1, 1, 0)
    assert counts(layout(8, auto_unified_max_cores=8)) == (0, 0, 1)


def test_explicit_layout_and_counts_win_over_the_rule():
    lay = layout(2, layout="disaggregated")
    assert counts(lay) == (1, 1, 0) and lay.threads == {"prefill": 1, "decode": 1}
    assert counts(layout(64, layout="unified")) == (0, 0, 1)
    lay = layout(2, num_decode=2)  # counts imply the layout
    assert counts(lay) == (1, 2, 0) and lay.threads == {"prefill": 1, "decode": 1}
    lay = layout(16, num_unified=4)
    assert counts(lay) == (0, 0, 4) and lay.threads == {"unified": 4}


def test_explicit_threads_are_every_workers():
    assert layout(2, num_threads=1).threads == {"unified": 1}
    assert layout(16, num_threads=3).threads == {"prefill": 3, "decode": 3}


@pytest.mark.parametrize("up,field", [
    ({"layout": "unified", "num_prefill": 1}, "up.num_prefill"),
    ({"layout": "unified", "num_decode": 2}, "up.num_decode"),
    ({"layout": "disaggregated", "num_unified": 1}, "up.num_unified"),
    ({"num_unified": 1, "num_decode": 1}, "up.num_unified"),
])
def test_counts_that_contradict_the_layout_name_the_setting(up, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        layout(2, **up)


def test_describe_names_every_role_and_its_threads():
    assert layout(2).describe() == "1 unified (2 threads each)"
    assert layout(2, layout="disaggregated").describe() == \
        "1 prefill (1 thread each), 1 decode (1 thread each)"


def clean_env(monkeypatch) -> None:
    for name in [leaf.env for leaf in leaves()]:
        monkeypatch.delenv(name, raising=False)


def test_cli_unified_flag_sets_the_layout_and_explicit_threads_are_seen(monkeypatch):
    clean_env(monkeypatch)
    loaded = cli._load(cli.build_parser().parse_args(["up", "--unified"]))
    assert loaded.settings.up.layout.value == "unified"
    assert loaded.source("up.layout") == "flag --unified"
    assert cli.up_layout(loaded).threads["unified"] >= 1
    loaded = cli._load(cli.build_parser().parse_args(["up", "--num-unified", "2",
                                                      "--num-threads", "1"]))
    lay = cli.up_layout(loaded)
    assert counts(lay) == (0, 0, 2) and lay.threads == {"unified": 1}


def test_cli_unified_flag_contradicting_layout_is_an_error(monkeypatch):
    clean_env(monkeypatch)
    with pytest.raises(SettingsError, match="up.layout: --unified contradicts"):
        cli._load(cli.build_parser().parse_args(["up", "--unified", "--layout", "disaggregated"]))


def test_cli_bad_count_names_the_setting(monkeypatch, capsys):
    clean_env(monkeypatch)
    assert cli.main(["up", "--num-prefill", "0"]) == 2
    assert "up.num_prefill: Input should be greater than 0 (got '0' from flag --num-prefill)" \
        in capsys.readouterr().err


def test_serve_has_no_up_flags():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "unified", "--layout", "unified"])
    assert cli.build_parser().parse_args(["serve", "unified"]).role == "unified"
