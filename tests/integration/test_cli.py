"""`tandem` as a person runs it: up (with its own redis-server), Ctrl-C, errors, generate."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import WORKER_ARGS, free_port

pytestmark = pytest.mark.integration
TANDEM = [sys.executable, "-m", "services.cli"]


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def env_without_redis_url() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "REDIS_URL"}


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
    redis_url = re.search(r"started redis-server at (\S+)", proc.stderr).group(1)
    assert processes_mentioning(redis_url) == []


def test_ctrl_c_stops_every_process():
    port = free_port()
    proc = subprocess.Popen([*TANDEM, "up", "--port", str(port), *WORKER_ARGS],
                            stderr=subprocess.PIPE, text=True, env=env_without_redis_url())
    log = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            log.append(line)
            if "Tandem is up" in line or not line:
                break
        assert "Tandem is up" in log[-1], "".join(log)[-3000:]
        redis_url = re.search(r"started redis-server at (\S+)", "".join(log)).group(1)
        assert len(processes_mentioning(redis_url)) == 3  # gateway, prefill, decode
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert processes_mentioning(redis_url) == []


def test_unreachable_redis_url_is_a_clear_error():
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    proc = subprocess.run([*TANDEM, "up", "--port", str(free_port())], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "REDIS_URL": url})
    assert proc.returncode == 1
    assert url in proc.stderr and "unreachable" in proc.stderr


def test_missing_redis_server_binary_is_a_clear_error(tmp_path):
    env = {**env_without_redis_url(), "PATH": str(tmp_path)}
    proc = subprocess.run([*TANDEM, "up", "--port", str(free_port())], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 1
    assert "redis-server" in proc.stderr and "apt-get install" in proc.stderr


def test_generate_in_process():
    proc = subprocess.run([*TANDEM, "generate", "What is the capital of France?", "--temperature", "0",
                           "--max-tokens", "12", "--num-threads", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout


def test_sigkill_of_tandem_up_takes_every_child_with_it():
    proc = subprocess.Popen([*TANDEM, "up", "--port", str(free_port()), *WORKER_ARGS],
                            stderr=subprocess.PIPE, text=True, env=env_without_redis_url())
    log = []
    try:
        while True:  # only the start-up matters here: kill as soon as the children exist
            line = proc.stderr.readline()
            log.append(line)
            if "started redis-server at" in line or not line:
                break
        redis_url = re.search(r"started redis-server at (\S+)", "".join(log)).group(1)
        time.sleep(2)
        assert processes_mentioning(redis_url)  # workers are starting
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20
    while processes_mentioning(redis_url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(redis_url) == []
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    assert processes_mentioning(f"--port\0{port}\0") == []  # the redis-server child too
