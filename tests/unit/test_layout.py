"""`tandem up`'s layout (services/runtime/layout.py): the auto rule by usable cores, explicit settings
winning over it, contradictions failing naming the setting, and the CLI's --unified."""
from __future__ import annotations

import pytest

from services.runtime import cli
from services.runtime.layout import WorkerLayout, choose_layout
from services.config.settings import UpSection
from services.config.sources import SettingsError, leaves


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


# -- GPUs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("listed,expected", [
    ("0", ["0"]), ("1,3", ["1", "3"]), (" 2 , 0 ", ["2", "0"]), ("", []), ("-1", []),
    ("0,-1,2", ["0"]), ("GPU-8c2f,MIG-1a", ["GPU-8c2f", "MIG-1a"]), ("0,,1", ["0"]),
])
def test_visible_gpus_reads_cuda_visible_devices_as_the_runtime_does(listed, expected):
    from services.runtime.layout import visible_gpus

    assert visible_gpus({"CUDA_VISIBLE_DEVICES": listed}) == expected


def test_visible_gpus_without_the_variable_counts_the_driver_s_gpus(monkeypatch):
    from services.runtime import layout as mod

    monkeypatch.setattr(mod.os, "listdir", lambda path: ["0000:18:00.0", "0000:3b:00.0"]
                        if path == "/proc/driver/nvidia/gpus" else [])
    assert mod.visible_gpus({}) == ["0", "1"]

    def no_driver(path):
        raise FileNotFoundError(path)
    monkeypatch.setattr(mod.os, "listdir", no_driver)
    assert mod.visible_gpus({}) == []


def test_auto_on_gpus_pairs_one_gpu_and_puts_a_unified_worker_on_each_of_several():
    from services.runtime.layout import gpu_placement

    one = choose_layout(UpSection(), 16, None, ["0"])
    assert counts(one) == (1, 1, 0) and one.gpus == ("0",) and "1 GPU" in one.reason
    assert gpu_placement(one, 0.9) == {"decode-0": ("0", 0.45), "prefill-0": ("0", 0.45)}
    unified = choose_layout(UpSection(layout="unified"), 16, None, ["0"])
    assert counts(unified) == (0, 0, 1) and gpu_placement(unified, 0.9) == {"unified-0": ("0", 0.9)}
    four = choose_layout(UpSection(), 2, None, ["0", "1", "2", "3"])
    assert counts(four) == (0, 0, 4) and four.threads == {"unified": 1}
    assert gpu_placement(four, 0.9) == {f"unified-{i}": (str(i), 0.9) for i in range(4)}
    assert "on GPUs 0,1,2,3" in four.describe()


def test_p_d_on_gpus_places_workers_round_robin_and_splits_the_memory_share():
    from services.runtime.layout import gpu_placement

    one = choose_layout(UpSection(layout="disaggregated"), 16, None, ["0"])
    assert counts(one) == (1, 1, 0)
    assert gpu_placement(one, 0.9) == {"decode-0": ("0", 0.45), "prefill-0": ("0", 0.45)}
    three = choose_layout(UpSection(num_prefill=2, num_decode=1), 16, None, ["a", "b"])
    assert gpu_placement(three, 0.8) == {"decode-0": ("a", 0.4), "prefill-0": ("b", 0.8),
                                         "prefill-1": ("a", 0.4)}
    assert gpu_placement(choose_layout(UpSection(), 2), 0.9) == {}  # CPU: no placement


def test_cuda_with_no_visible_gpu_names_the_device_setting():
    with pytest.raises(ValueError, match="engine.device"):
        choose_layout(UpSection(), 4, None, [])


def test_gateways_are_one_on_cpus_and_one_per_4_cores_up_to_4_on_gpus():
    """A GPU decodes faster than one gateway relays (4 gateways: 1.19x / 1.45x the tokens/s of
    one at 16 / 64 clients on an H200 with 16 host cores); on a CPU the model is the bound and
    more gateways take its cores. ``up.num_gateways`` wins over the rule."""
    assert layout(2).num_gateways == 1 and layout(64).num_gateways == 1  # CPU
    on_gpu = {cores: choose_layout(UpSection(), cores, None, ["0"]).num_gateways
              for cores in (2, 4, 8, 16, 64)}
    assert on_gpu == {2: 1, 4: 1, 8: 2, 16: 4, 64: 4}
    unified = choose_layout(UpSection(layout="unified"), 16, None, ["0", "1"])
    assert unified.num_gateways == 4 and unified.describe().endswith(", 4 gateways")
    assert choose_layout(UpSection(num_gateways=1), 16, None, ["0"]).num_gateways == 1
    assert layout(2, num_gateways=3).num_gateways == 3
    # a drawn gateway port (0) cannot be shared: the rule keeps one, an explicit count stays
    drawn = choose_layout(UpSection(), 16, None, ["0"], shared_port=False)
    assert drawn.num_gateways == 1 and "gateways" not in drawn.describe()
    assert choose_layout(UpSection(num_gateways=2), 16, None, ["0"],
                         shared_port=False).num_gateways == 2


def test_up_keeps_one_gateway_on_a_drawn_port_unless_asked(monkeypatch, capsys):
    """Gateways share a fixed port (SO_REUSEPORT): with port 0 the rule's count falls back to
    one, and an explicit count still meets ``UpOptions``' error."""
    started = []

    class FakeStack:
        def __init__(self, opts):
            started.append(opts.num_gateways)

        def start(self):
            raise SystemExit(0)

        def stop(self):
            pass

    from services.runtime import launcher, layout as layout_module

    monkeypatch.setattr(launcher, "Stack", FakeStack)
    monkeypatch.setattr(layout_module, "visible_gpus", lambda: ["0"])
    monkeypatch.setattr(layout_module, "usable_cores", lambda: 16)
    for argv, expected in ((["--device", "cuda", "--port", "0"], 1),
                           (["--device", "cuda", "--port", "50999"], 4)):
        with pytest.raises(SystemExit):
            cli.main(["up", *argv])
        assert started[-1] == expected
    try:
        code = cli.main(["up", "--device", "cuda", "--port", "0", "--num-gateways", "2"])
    except SystemExit as exc:
        code = exc.code
    assert code != 0 and "up.num_gateways: gateways share a fixed port" in capsys.readouterr().err
    assert len(started) == 2
