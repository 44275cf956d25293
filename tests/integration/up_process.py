"""`tandem up` as a person runs it (``python -m services.runtime.cli up``), observed from outside: its
log, its children (found by the run's settings file on their command line) and its Redis.
Every wait is on a condition with a deadline."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

TANDEM = [sys.executable, "-m", "services.runtime.cli"]


def env_without_redis_url() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "REDIS_URL"}


def processes_mentioning(*parts: str) -> list[int]:
    """Pids whose command line contains every one of ``parts`` (NUL-separated argv)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                cmdline = (proc / "cmdline").read_bytes()
                if all(p.encode() in cmdline for p in parts) and not _zombie(proc):
                    pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def _zombie(proc: Path) -> bool:
    return (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def zombies_of(pid: int) -> list[int]:
    """Children of ``pid`` that exited and were never reaped."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                if fields[0] == "Z" and int(fields[1]) == pid:
                    out.append(int(proc.name))
        except OSError:
            continue
    return out


def wait_until(condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.1):
    """``condition()``'s first truthy value within ``timeout_s`` seconds; AssertionError naming
    ``what`` otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(poll_s)


class UpProcess:
    """A running ``tandem up``; stderr is collected by a thread so no read blocks a test."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([*TANDEM, "up", *args], stderr=subprocess.PIPE, text=True,
                                     env=env if env is not None else env_without_redis_url())
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_for_log(self, pattern: str, timeout_s: float) -> re.Match:
        def found():
            match = re.search(pattern, self.log)
            assert match or self.proc.poll() is None, f"tandem up exited:\n{self.log[-3000:]}"
            return match
        return wait_until(found, timeout_s, f"{pattern!r} in the log")

    def wait_ready(self, timeout_s: float = 300) -> None:
        self.wait_for_log("Tandem is up", timeout_s)

    @property
    def settings_file(self) -> str:
        return re.search(r"children read their settings from (\S+)", self.log).group(1)

    def settings(self) -> dict:
        return json.loads(Path(self.settings_file).read_text())

    def children(self) -> list[int]:
        return processes_mentioning(self.settings_file)

    def pid_of(self, worker_id: str) -> int:
        pids = processes_mentioning(self.settings_file, f"--worker-id\0{worker_id}\0")
        assert len(pids) == 1, (worker_id, pids)
        return pids[0]

    @property
    def redis_port(self) -> int:
        return int(re.search(r"started redis-server at \S+:(\d+)/0", self.log).group(1))

    def redis_pids(self) -> list[int]:
        # NOTE: redis-server rewrites its command line to "redis-server HOST:PORT"
        return processes_mentioning(f"redis-server 127.0.0.1:{self.redis_port}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()
        self._reader.join(timeout=5)
        return self.proc.returncode
