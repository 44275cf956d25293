"""`tandem` as a person runs it: up (with its own redis-server), Ctrl-C, errors, generate.
Every wait is on a condition with a deadline; nothing asserts how long anything took."""
from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import WORKER_ARGS, free_port
from tests.integration.up_process import (
    TANDEM, UpProcess, env_without_redis_url, processes_mentioning, wait_until)

pytestmark = pytest.mark.integration


def test_up_with_chat_answers_and_leaves_nothing_running():
    port = free_port()
    proc = subprocess.run(
        [*TANDEM, "up", "--port", str(port), *WORKER_ARGS, "--chat", "What is the capital of France?",
         "--temperature", "0", "--max-tokens", "16"],
        capture_output=True, text=True, timeout=300, env=env_without_redis_url())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout
    assert "finish_reason=" in proc.stdout
    assert f"gateway listening on 127.0.0.1:{port}" in proc.stderr
    settings_file = re.search(r"children read their settings from (\S+)", proc.stderr).group(1)
    redis_port = re.search(r"started redis-server at redis://:\*\*\*@127.0.0.1:(\d+)/0 "
                           r"\(password set", proc.stderr).group(1)
    output = proc.stdout + proc.stderr
    assert not re.search(r"redis://:(?!\*\*\*@)", output), "a Redis password was printed"
    assert processes_mentioning(settings_file) == []
    assert processes_mentioning(f"redis-server 127.0.0.1:{redis_port}") == []
    assert not Path(settings_file).exists()  # the run's secrets are gone with it


def test_ctrl_c_stops_every_process():
    up = UpProcess(["--port", str(free_port()), "--layout", "disaggregated", *WORKER_ARGS])
    try:
        up.wait_ready(240)
        assert len(up.children()) == 3  # gateway, prefill, decode
        assert len(up.redis_pids()) == 1
        settings_file = up.settings_file
        assert up.stop() == 0, up.log[-4000:]  # the end of the log: what did not stop
    finally:
        up.proc.kill()
    assert processes_mentioning(settings_file) == []
    assert up.redis_pids() == []


def test_unreachable_redis_url_is_a_clear_error():
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    proc = subprocess.run([*TANDEM, "up", "--port", str(free_port())], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "REDIS_URL": url})
    assert proc.returncode == 1
    assert url in proc.stderr and "unreachable" in proc.stderr


def test_password_of_an_unreachable_redis_url_is_not_printed():
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    proc = subprocess.run([*TANDEM, "up", "--port", str(free_port())], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "REDIS_URL": url})
    assert proc.returncode == 1 and "unreachable" in proc.stderr
    assert "hunter2" not in proc.stderr + proc.stdout


def test_missing_redis_server_binary_is_a_clear_error(tmp_path):
    env = {**env_without_redis_url(), "PATH": str(tmp_path)}
    proc = subprocess.run([*TANDEM, "up", "--port", str(free_port())], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 1
    assert "redis-server" in proc.stderr and "apt-get install" in proc.stderr


def test_bad_setting_fails_before_anything_starts():
    proc = subprocess.run([*TANDEM, "up", "--kv-transport", "ucx"], capture_output=True, text=True,
                          timeout=60, env={**env_without_redis_url(), "TANDEM_MAX_INFLIGHT": "-1"})
    assert proc.returncode == 2
    assert "transport.kv_transport: Input should be 'tcp' or 'nixl' (got 'ucx' from flag --kv-transport)" in proc.stderr
    assert "gateway.max_inflight: Input should be greater than 0 (got '-1' from env TANDEM_MAX_INFLIGHT)" in proc.stderr
    assert "started redis-server" not in proc.stderr


def test_generate_in_process():
    proc = subprocess.run([*TANDEM, "generate", "What is the capital of France?", "--temperature", "0",
                           "--max-tokens", "12", "--num-threads", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout


def test_sigkill_of_tandem_up_takes_every_child_with_it():
    up = UpProcess(["--port", str(free_port()), "--layout", "disaggregated", *WORKER_ARGS])
    try:  # only the start-up matters here: kill as soon as the children exist
        up.wait_for_log(r"children read their settings from", 120)
        wait_until(lambda: len(up.children()) == 3, 60, "gateway, prefill and decode to start")
        assert len(up.redis_pids()) == 1
    finally:
        up.proc.kill()
        up.proc.wait()
    wait_until(lambda: not up.children(), 20, "every child to exit")
    wait_until(lambda: not up.redis_pids(), 20, "the redis-server child to exit")


def test_a_gateway_whose_metrics_port_is_taken_exits_naming_it(redis_url):
    """A taken /metrics port (HTTP off, so the gateway serves /metrics on a port of its own) is
    an error exit naming it, before the gRPC server starts: once a started server was left
    behind, the process hung in its teardown and ignored SIGTERM."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = taken.getsockname()[1]
        proc = subprocess.run(
            [*TANDEM, "serve", "gateway", "--port", str(free_port()), "--http-port", "0",
             "--gateway-metrics-port", str(busy)],
            capture_output=True, text=True, timeout=120, env={**os.environ, "REDIS_URL": redis_url})
    assert proc.returncode != 0
    assert f"metrics port: cannot listen on 127.0.0.1:{busy}" in proc.stderr, proc.stderr[-2000:]
    assert "gateway listening" not in proc.stderr


def test_a_gateway_whose_http_port_is_taken_exits_with_one_line_naming_it(redis_url):
    """A taken HTTP port is an error exit (1) whose last line names the address, with
    uvicorn's own error above it and no traceback: uvicorn ends a failed start with
    ``sys.exit(3)``, which, raised in the gateway's event loop, used to end the process
    with nothing of ours said."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = taken.getsockname()[1]
        proc = subprocess.run(
            [*TANDEM, "serve", "gateway", "--port", str(free_port()), "--http-port", str(busy)],
            capture_output=True, text=True, timeout=120, env={**os.environ, "REDIS_URL": redis_url})
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tandem serve: error: cannot serve HTTP on 127.0.0.1:{busy}"), last
    assert "address already in use" in proc.stderr.lower() and "Traceback" not in proc.stderr
    assert "gateway listening" not in proc.stderr
