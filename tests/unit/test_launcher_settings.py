"""What `tandem up` hands its children: one settings file (0600, secrets in it, never on argv)
and an environment in which no setting's variable contradicts that file."""
from __future__ import annotations

import json
import stat

import pytest

from services.runtime.launcher import Stack, UpOptions
from services.config.sources import load_settings


def make_stack(monkeypatch, **opts) -> Stack:
    monkeypatch.setenv("TANDEM_PORT", "6001")  # a parent's setting the children must not re-read
    monkeypatch.setenv("TANDEM_MAX_WAITING", "17")
    stack = Stack(UpOptions(host="127.0.0.1", port=7000, num_prefill=1, num_decode=1,
                            redis_url="redis://:pw@127.0.0.1:1/0", **opts))
    stack._write_settings()
    return stack


def test_children_get_one_private_file_with_the_effective_settings(monkeypatch):
    stack = make_stack(monkeypatch, env={"TANDEM_TEST_FAULT_INJECTION": "1"})
    try:
        assert stat.S_IMODE(stack.settings_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(stack.run_dir.stat().st_mode) == 0o700
        data = json.loads(stack.settings_file.read_text())
        assert data["gateway"]["port"] == 7000 and data["worker"]["max_waiting"] == 17
        assert data["state"]["redis_url"] == "redis://:pw@127.0.0.1:1/0"
        secret = data["transport"]["internal_secret"]
        assert len(secret) >= 32
        env = stack.child_env
        assert "TANDEM_PORT" not in env and "TANDEM_MAX_WAITING" not in env
        assert env["TANDEM_INTERNAL_SECRET"] == secret and env["TANDEM_TEST_FAULT_INJECTION"] == "1"
        argv = stack._serve("decode")
        assert argv[-2:] == ["--config", str(stack.settings_file)]
        assert not any(secret in a or "pw" in a for a in argv)
        child = load_settings(None, stack.settings_file, env).settings
        assert child.gateway.port == 7000 and child.worker.fault_injection
        assert child.internal_secret() == secret
    finally:
        stack.stop()
    assert not stack.run_dir.exists()


def test_secret_is_new_per_run_unless_one_is_given(monkeypatch):
    a, b = make_stack(monkeypatch), make_stack(monkeypatch)
    try:
        assert a.settings.internal_secret() != b.settings.internal_secret()
    finally:
        a.stop(), b.stop()
    monkeypatch.setenv("TANDEM_INTERNAL_SECRET", "given-0123456789")
    c = make_stack(monkeypatch)
    try:
        assert c.settings.internal_secret() == "given-0123456789" == c.child_env["TANDEM_INTERNAL_SECRET"]
    finally:
        c.stop()


def test_each_gpu_worker_gets_its_device_and_memory_share(monkeypatch):
    """`tandem up` on GPUs: CUDA_VISIBLE_DEVICES and --gpu-memory-utilization per worker, the
    rest of the environment shared; a worker's settings parse with that share."""
    started = []
    fake_spawn(monkeypatch, started)
    stack = Stack(UpOptions(host="127.0.0.1", port=7000, num_prefill=2, num_decode=1,
                            redis_url="redis://127.0.0.1:1/0",
                            gpus={"decode-0": ("0", 0.45), "prefill-0": ("0", 0.45),
                                  "prefill-1": ("GPU-b", 0.9)}))
    try:
        stack.start()
        (dargv, denv), (pargv, penv), (_, p1env) = started
        # its own GPU first (its cuda device), the stack's others after: a peer's cache on
        # another GPU can be opened by CUDA IPC
        assert denv["CUDA_VISIBLE_DEVICES"] == "0,GPU-b" == penv["CUDA_VISIBLE_DEVICES"]
        assert p1env["CUDA_VISIBLE_DEVICES"] == "GPU-b,0"
        assert "CUDA_VISIBLE_DEVICES" not in stack.child_env
        i = dargv.index("--gpu-memory-utilization")
        assert dargv[i + 1] == "0.4500" and "--worker-id" in dargv
        from services.runtime import cli

        child = cli._load(cli.build_parser().parse_args(dargv[dargv.index("serve"):]))
        assert child.settings.engine.gpu_memory_utilization == 0.45
    finally:
        stack.stop()


def test_a_programmatic_stack_on_cuda_splits_each_gpu_between_its_workers(monkeypatch):
    """A Stack started without placements (benchmarks, tests) when the settings put the engine
    on CUDA is placed as `tandem up` places it: a prefill and a decode worker sharing one GPU
    each size their KV cache from half of gpu_memory_utilization (each taking 0.9 of an H100,
    the second ran out of memory at start)."""
    started = []
    fake_spawn(monkeypatch, started)
    monkeypatch.setenv("TANDEM_DEVICE", "cuda")
    monkeypatch.setenv("TANDEM_GPU_MEMORY_UTILIZATION", "0.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    stack = Stack(UpOptions(host="127.0.0.1", port=7000, num_prefill=1, num_decode=1,
                            redis_url="redis://127.0.0.1:1/0"))
    try:
        stack.start()
        assert stack.gpus == {"decode-0": ("3", 0.4), "prefill-0": ("3", 0.4)}
        for argv, env in started:
            assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.4000"
            assert env["CUDA_VISIBLE_DEVICES"] == "3"
    finally:
        stack.stop()
    monkeypatch.setenv("TANDEM_DEVICE", "cpu")  # on CPUs: no placement, nothing added
    started.clear()
    stack = Stack(UpOptions(host="127.0.0.1", port=7000, num_prefill=1, num_decode=1,
                            redis_url="redis://127.0.0.1:1/0"))
    try:
        stack.start()
        assert stack.gpus == {} and len(started) == 2
        assert not any("--gpu-memory-utilization" in argv for argv, _ in started)
    finally:
        stack.stop()


def fake_spawn(monkeypatch, started: list) -> None:
    """Children that are never started: ``started`` receives each one's (argv, env)."""
    from services.runtime import launcher

    class Exited:
        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(launcher, "spawn", lambda argv, env: started.append((argv, env)) or Exited())
    monkeypatch.setattr(launcher, "start_redis_server", None)  # a redis_url is given: not called
    monkeypatch.setattr(Stack, "add_gateway", lambda self, name, port, **options: None)
    monkeypatch.setattr(launcher, "write_scrape_config", lambda path, targets: path)
    monkeypatch.setattr(launcher, "check_redis", lambda url: _done())


async def _done():
    return None


def test_a_free_metrics_port_is_drawn_again_when_an_earlier_child_holds_it(monkeypatch):
    """A child started earlier may not have bound its /metrics port yet, so the OS can hand
    the same free port out again: the launcher draws another instead of failing. Nor is a
    port the gateway binds only once it starts ever drawn: its gRPC port (the caller's, 7000
    here) and its HTTP port. A fixed port that two children would share is refused, naming the
    setting."""
    from services.runtime import launcher

    stack = make_stack(monkeypatch)
    try:
        draws = iter([7000, stack.settings.gateway.http_port, 9100, 9100, 9101])
        monkeypatch.setattr(launcher, "free_port", lambda host: next(draws))
        assert stack._metrics_port("decode-0", 0, "worker.metrics_port") == 9100
        assert stack._metrics_port("decode-1", 0, "worker.metrics_port") == 9101
        assert stack.metrics_targets["decode-1"] == "127.0.0.1:9101"
        with pytest.raises(ValueError, match="worker.metrics_port: port 9101 would be shared"):
            stack._metrics_port("decode-2", 9101, "worker.metrics_port")
    finally:
        stack.stop()


def test_no_port_a_child_s_flags_name_is_drawn_for_metrics(monkeypatch):
    """The caller's child flags may name ports (a test's ``--http-port``): the gateway binds
    them only once it runs, so a free port drawn for a worker's /metrics must not be one of
    them (a CI run's gateway once found its HTTP port taken)."""
    from services.runtime import launcher

    assert launcher.flag_ports(["--http-port", "8123", "--heartbeat-s", "0.5",
                                "--metrics-port=9200", "--port", "x", "--http-port"]) == {8123, 9200}
    stack = make_stack(monkeypatch, gateway_args=["--http-port", "8123"],
                       worker_args=["--gateway-metrics-port=8124"])
    try:
        draws = iter([8123, 8124, 9100])
        monkeypatch.setattr(launcher, "free_port", lambda host: next(draws))
        assert stack._metrics_port("decode-0", 0, "worker.metrics_port") == 9100
    finally:
        stack.stop()


def test_gateways_sharing_a_port_need_a_fixed_one():
    with pytest.raises(ValueError, match="up.num_gateways"):
        UpOptions(host="127.0.0.1", port=0, num_prefill=1, num_decode=1, redis_url=None,
                  num_gateways=2)
    assert UpOptions(host="127.0.0.1", port=0, num_prefill=1, num_decode=1,
                     redis_url=None).num_gateways == 1
