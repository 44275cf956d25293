"""The settings tree: one default per setting, flags > env > file > defaults, errors that name
the setting and its source, secrets never shown, the README's table generated from the tree."""
from __future__ import annotations

import re
import stat
import sys
import types
from pathlib import Path

import pytest

from services.runtime import cli
from services.engine.engine import EngineConfig
from services.config.settings import DType, Quantization, KVFailurePolicy, KVTransportKind, LogLevel, Settings
from services.config.sources import (
    SettingsError, leaves, load_settings, markdown_table, show_lines, write_settings_file)

README = Path(__file__).resolve().parents[2] / "README.md"
# every environment variable and flag the README, tests and deployments used before the tree
OLD_ENV = ["REDIS_URL", "TANDEM_HOST", "TANDEM_ADVERTISE_HOST", "TANDEM_PORT", "TANDEM_WORKER_PORT",
           "TANDEM_KV_PORT", "TANDEM_MODEL", "TANDEM_DEVICE", "TANDEM_DTYPE", "TANDEM_KV_TRANSPORT",
           "TANDEM_KV_CACHE_GIB", "TANDEM_NUM_THREADS", "TANDEM_HEARTBEAT_S", "TANDEM_KV_LEASE_S",
           "TANDEM_KV_TRANSFER_TIMEOUT_S", "TANDEM_KV_FAILURE_POLICY", "TANDEM_MAX_WAITING",
           "TANDEM_MAX_INFLIGHT", "TANDEM_RPC_TIMEOUT_S", "TANDEM_LOG_LEVEL",
           "TANDEM_TEST_FAULT_INJECTION", "TANDEM_INTERNAL_SECRET", "TANDEM_INTERNAL_SECRET_FILE"]
OLD_FLAGS = ["--model", "--device", "--dtype", "--block-size", "--kv-cache-gib", "--num-kv-blocks",
             "--max-num-seqs", "--max-num-batched-tokens", "--num-threads", "--kv-failure-policy",
             "--max-inflight", "--kv-lease-s", "--kv-transfer-timeout-s", "--max-waiting", "--host",
             "--advertise-host", "--redis-url", "--heartbeat-s", "--rpc-timeout-s", "--port",
             "--kv-port", "--worker-id", "--kv-transport", "--log-level"]


def test_engine_defaults_are_engine_configs_own_but_a_served_worker_picks_precision_and_threads():
    engine = Settings().engine
    assert engine.dtype is DType.auto and engine.quantization is Quantization.auto
    assert engine.engine_config() == EngineConfig(dtype="auto", quantization="auto",
                                                  step_threads="auto", queue_policy="srpt",
                                                  max_step_ms=150.0)
    assert (EngineConfig().dtype, EngineConfig().quantization, EngineConfig().step_threads,
            EngineConfig().queue_policy, EngineConfig().max_step_ms) == (
        "float32", "none", "all", "fcfs", None)


def test_every_old_env_var_and_flag_still_names_a_setting_and_none_twice():
    envs = [leaf.env for leaf in leaves()]
    flags = [leaf.flag for leaf in leaves() if leaf.flag]
    assert len(envs) == len(set(envs)) and len(flags) == len(set(flags))
    assert set(OLD_ENV) <= set(envs)
    assert set(OLD_FLAGS) <= set(flags)


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    conf = tmp_path / "t.yaml"
    conf.write_text("gateway:\n  port: 6000\n  max_inflight: 7\nworker:\n  max_waiting: 9\n")
    env = {"TANDEM_PORT": "6001", "TANDEM_MAX_INFLIGHT": "8"}
    flags = {"gateway.port": ("6002", "flag --port")}
    loaded = load_settings(flags, conf, env)
    s = loaded.settings
    assert (s.gateway.port, s.gateway.max_inflight, s.worker.max_waiting) == (6002, 8, 9)
    assert s.state.heartbeat_s == 1.0
    assert loaded.source("gateway.port") == "flag --port"
    assert loaded.source("gateway.max_inflight") == "env TANDEM_MAX_INFLIGHT"
    assert loaded.source("worker.max_waiting") == f"file {conf} line 5"
    assert loaded.source("state.heartbeat_s") == "default"


def test_empty_env_var_counts_as_unset():
    assert load_settings(environ={"TANDEM_PORT": ""}).settings.gateway.port == 50051


@pytest.mark.parametrize("env,flags,needle", [
    ({"TANDEM_PORT": "x"}, {}, "gateway.port: Input should be a valid integer"),
    ({"TANDEM_KV_TRANSPORT": "ucx"}, {}, "transport.kv_transport: Input should be 'tcp' or 'nixl'"),
    ({}, {"gateway.max_inflight": ("0", "flag --max-inflight")}, "gateway.max_inflight: Input should be greater than 0"),
    ({"TANDEM_DEVICE": "tpu"}, {}, "engine.device: Input should be 'cpu' or 'cuda'"),
    ({"TANDEM_KV_FAILURE_POLICY": "retry"}, {}, "gateway.kv_failure_policy"),
])
def test_bad_value_names_setting_and_source(env, flags, needle):
    with pytest.raises(SettingsError) as err:
        load_settings(flags, None, env)
    msg = str(err.value)
    assert needle in msg
    source = next(iter(flags.values()))[1] if flags else f"env {next(iter(env))}"
    assert f"from {source})" in msg


def test_bad_value_in_file_names_its_line(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("# comment\ntransport:\n  kv_transport: ucx\n")
    with pytest.raises(SettingsError, match=rf"transport.kv_transport: .*from file {yaml_file} line 3"):
        load_settings(None, yaml_file, {})
    toml_file = tmp_path / "c.toml"
    toml_file.write_text('[gateway]\nport = 1\n\n[state]\nheartbeat_s = -1\n')
    with pytest.raises(SettingsError, match=rf"state.heartbeat_s: .*from file {toml_file} line 5"):
        load_settings(None, toml_file, {})
    unknown = tmp_path / "u.yaml"
    unknown.write_text("gateway:\n  prot: 1\n")
    with pytest.raises(SettingsError, match=rf"gateway.prot: unknown setting \(from file {unknown} line 2\)"):
        load_settings(None, unknown, {})


def test_enums_and_log_level_case():
    s = load_settings(environ={"TANDEM_LOG_LEVEL": "debug", "TANDEM_KV_TRANSPORT": "nixl",
                               "TANDEM_KV_FAILURE_POLICY": "fail"}).settings
    assert s.log_level is LogLevel.DEBUG
    assert s.transport.kv_transport is KVTransportKind.nixl
    assert s.gateway.kv_failure_policy is KVFailurePolicy.fail


def test_show_masks_secrets_and_redis_password():
    loaded = load_settings(environ={"TANDEM_INTERNAL_SECRET": "hunter2-hunter2-hunter2",
                                    "REDIS_URL": "redis://:pw123@10.0.0.1:6379/0"})
    text = "\n".join(show_lines(loaded))
    assert "hunter2-hunter2-hunter2" not in text and "pw123" not in text
    assert 'state.redis_url = "redis://:***@10.0.0.1:6379/0"  # env REDIS_URL' in text
    assert 'transport.internal_secret = "***"  # env TANDEM_INTERNAL_SECRET' in text
    assert loaded.settings.internal_secret() == "hunter2-hunter2-hunter2"
    with pytest.raises(SettingsError) as err:
        load_settings(environ={"REDIS_URL": "redis://:pw123@h:1/0", "TANDEM_PORT": "x"})
    assert "pw123" not in str(err.value)


def test_internal_secret_file(tmp_path):
    (tmp_path / "s").write_text("from-a-file-0123456789\n")
    s = load_settings(environ={"TANDEM_INTERNAL_SECRET_FILE": str(tmp_path / "s")}).settings
    assert s.internal_secret() == "from-a-file-0123456789"
    missing = load_settings(environ={"TANDEM_INTERNAL_SECRET_FILE": str(tmp_path / "no")}).settings
    with pytest.raises(ValueError, match="^TANDEM_INTERNAL_SECRET_FILE: cannot read"):
        missing.internal_secret()


def test_internal_secret_follows_the_workers_rules(tmp_path):
    """The settings tree reads the secret as services.auth does: 16+ characters, one source."""
    (tmp_path / "s").write_text("from-a-file-0123456789\n")
    both = load_settings(environ={"TANDEM_INTERNAL_SECRET": "from-env-0123456789",
                                  "TANDEM_INTERNAL_SECRET_FILE": str(tmp_path / "s")}).settings
    with pytest.raises(ValueError, match="^TANDEM_INTERNAL_SECRET: .*not both"):
        both.internal_secret()
    short = load_settings(environ={"TANDEM_INTERNAL_SECRET": "hunter2"}).settings
    with pytest.raises(ValueError, match="^TANDEM_INTERNAL_SECRET: .*16 characters"):
        short.internal_secret()


def test_children_file_round_trips_with_secrets_and_is_private(tmp_path):
    env = {"TANDEM_INTERNAL_SECRET": "hunter2-hunter2-hunter2", "REDIS_URL": "redis://:pw@h:1/0",
           "TANDEM_DTYPE": "bfloat16", "TANDEM_NUM_KV_BLOCKS": "12"}
    original = load_settings(environ=env).settings
    path = tmp_path / "settings.json"
    write_settings_file(original, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_settings(None, path, {})
    assert again.settings == original
    assert again.settings.internal_secret() == "hunter2-hunter2-hunter2"
    assert again.source("engine.dtype") == f"file {path} line {_line_of(path, 'dtype')}"


def _line_of(path: Path, key: str) -> int:
    return next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if f'"{key}"' in ln)


def test_readme_settings_table_is_generated_from_the_tree():
    text = README.read_text()
    found = re.search(r"<!-- settings-table:start[^\n]*-->\n(.*?)\n<!-- settings-table:end -->",
                      text, re.S)
    assert found, "README.md lost its settings-table markers"
    assert found.group(1) == markdown_table(), "stale: paste `tandem config show --markdown`"


def test_cli_serve_port_is_the_roles_port(monkeypatch):
    for name in [leaf.env for leaf in leaves()]:
        monkeypatch.delenv(name, raising=False)
    args = cli.build_parser().parse_args(["serve", "decode", "--port", "7001"])
    s = cli._load(args).settings
    assert (s.worker.port, s.gateway.port) == (7001, 50051)
    args = cli.build_parser().parse_args(["serve", "gateway", "--port", "7002"])
    assert cli._load(args).settings.gateway.port == 7002


def test_cli_bad_setting_fails_at_start_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_HEARTBEAT_S", "soon")
    assert cli.main(["serve", "decode"]) == 2
    err = capsys.readouterr().err
    assert "tandem serve: error: invalid settings: state.heartbeat_s:" in err
    assert "(got 'soon' from env TANDEM_HEARTBEAT_S)" in err


def test_cli_bench_dispatches_to_the_modes_main(monkeypatch):
    seen = []
    fake = types.ModuleType("loadtest.plot")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "loadtest.plot", fake)
    assert cli.main(["bench", "plot", "--", "--x", "1"]) == 3
    assert seen == [["--x", "1"]]


def test_cli_bench_of_a_missing_module_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "loadtest.sweep", None)  # import raises ModuleNotFoundError
    assert cli.main(["bench", "sweep"]) == 1
    assert "loadtest.sweep is not in this checkout" in capsys.readouterr().err


def test_the_queue_policy_setting_names_what_the_scheduler_implements():
    from services.config.choices import QueuePolicy
    from services.engine.engine_config import QUEUE_POLICIES
    assert {p.value for p in QueuePolicy} == set(QUEUE_POLICIES)


def test_readme_settings_error_is_what_a_bad_value_prints():
    """README.md quotes the error a bad TANDEM_PORT gets; it must be the error printed."""
    import re
    from pathlib import Path

    from services.config.sources import SettingsError, load_settings
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    quoted = re.search(r"\(`(gateway\.port: [^`]+from env TANDEM_PORT\))`\)", readme)
    assert quoted, "README.md lost its quoted settings error"
    with pytest.raises(SettingsError) as err:
        load_settings(environ={"TANDEM_PORT": "x"})
    assert " ".join(quoted.group(1).split()) in str(err.value)  # README wraps its lines
