"""A throwaway `redis-server` child process, and a reachability check for any Redis URL.

`tandem up` and the tests start Redis with `start_redis_server()`: a child process on a free
loopback port with persistence off (nothing is written to disk), optionally with a password
(`requirepass`, written to a config file only this user can read, never on the command line),
stopped with `.stop()` or by leaving its `with` block; `.restart()` starts it again on the same
port with the same password (its data is gone: persistence is off). Services check their
configured Redis with `check_redis(url)` at start so a wrong URL fails with one clear line
instead of a retry storm.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.ports import listen_port
from services.runtime.process import die_with_parent

REDIS_BINARY = "redis-server"
INSTALL_HINT = ("install it with `apt-get install -y redis-server` (Debian/Ubuntu) "
                "or `brew install redis` (macOS), or set REDIS_URL to a running Redis "
                "(`tandem up` then starts none)")
_PORT_ATTEMPTS = 3  # a free port picked by us can be taken before redis binds it; retry then


class RedisServer:
    """A running `redis-server` child process bound to `host:port`, database 0.

    Use `.url` to connect; `.stop()` (or leaving a `with` block) terminates it. The server keeps
    everything in memory (`--save '' --appendonly no`); its log lives in a temporary directory
    that is removed on stop.
    """

    def __init__(self, process: subprocess.Popen[bytes], host: str, port: int,
                 workdir: tempfile.TemporaryDirectory[str], password: str | None = None) -> None:
        self.process = process
        self.host = host
        self.port = port
        self.password = password
        self._workdir = workdir

    @property
    def url(self) -> str:
        """`redis://HOST:PORT/0`, or `redis://:PASSWORD@HOST:PORT/0` (never log it: see
        `safe_url`)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def safe_url(self) -> str:
        """`url` with the password replaced by `***`."""
        return redact_url(self.url)

    @property
    def log_path(self) -> Path:
        return Path(self._workdir.name) / "redis.log"

    def is_running(self) -> bool:
        """False once the process has exited (and it is reaped then: no zombie)."""
        return self.process.poll() is None

    def restart(self, timeout_s: float = 10.0) -> None:
        """Start the server again on the same host, port and password, after killing what is
        left of the old process. Raises RuntimeError as `start_redis_server` does."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process = _popen(shutil.which(REDIS_BINARY) or REDIS_BINARY, self.host, self.port,
                              self._workdir.name)
        try:
            _wait_until_ready(self, timeout_s)
        except _ExitedEarly as exc:
            raise RuntimeError(str(exc)) from None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the server (SIGTERM), wait up to `timeout_s` seconds, then SIGKILL it.

        Idempotent: stopping a stopped server does nothing.
        """
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._workdir.cleanup()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else f"exited {self.process.returncode}"
        return f"RedisServer({self.safe_url}, pid={self.process.pid}, {state})"


def start_redis_server(host: str = "127.0.0.1", port: int = 0, *,
                       startup_timeout_s: float = 10.0, password: str | None = None) -> RedisServer:
    """Start `redis-server` on `host:port` (port 0: a free port) and wait until it answers PING.

    Persistence is off (`--save '' --appendonly no`) and its working directory is a temporary
    one. With `password`, clients must AUTH (`requirepass`); the URL carries it. Waits at most
    `startup_timeout_s` seconds.

    Raises:
        RuntimeError: the `redis-server` binary is not on PATH (the message says how to install
            it), the server exited during start-up (the message quotes its log), or it did not
            answer PING within `startup_timeout_s` (it is killed then).
    """
    binary = shutil.which(REDIS_BINARY)
    if binary is None:
        raise RuntimeError(f"`{REDIS_BINARY}` was not found on PATH; {INSTALL_HINT}")
    attempts = _PORT_ATTEMPTS if port == 0 else 1
    for attempt in range(attempts):
        chosen = port or listen_port(host)
        server = _spawn(binary, host, chosen, password)
        try:
            _wait_until_ready(server, startup_timeout_s)
            return server
        except _ExitedEarly as exc:
            server.stop()
            if attempt + 1 == attempts:
                raise RuntimeError(str(exc)) from None
        except BaseException:
            server.stop()
            raise
    raise AssertionError("unreachable")


async def check_redis(url: str, timeout_s: float = 2.0) -> None:
    """Return if the Redis at `url` answers PING within `timeout_s` seconds.

    Raises:
        ConnectionError: it could not be reached or did not answer in time (the message names
            the URL and the cause).
        ValueError: `url` is not a Redis URL.
    """
    client = aioredis.Redis.from_url(
        url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0))
    try:
        async with asyncio.timeout(timeout_s):
            await client.ping()
    except (redis.RedisError, OSError, TimeoutError) as exc:
        cause = str(exc) or type(exc).__name__
        raise ConnectionError(
            f"Redis at {redact_url(url)} is unreachable (no PING answer within {timeout_s}s): {cause}"
        ) from exc
    finally:
        await client.aclose()


class _ExitedEarly(Exception):
    """The child exited before answering PING (for instance: its port was taken)."""


def redact_url(url: str) -> str:
    """`url` with any password replaced by `***`, safe to log or print."""
    return re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", url)


def _spawn(binary: str, host: str, port: int, password: str | None) -> RedisServer:
    workdir = tempfile.TemporaryDirectory(prefix="tandem-redis-")  # mode 0700
    conf = os.open(Path(workdir.name) / "redis.conf", os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(conf, "w") as f:  # NOTE: a password on argv would be in /proc/PID/cmdline
        f.write(f"requirepass {password}\n" if password else "")
    return RedisServer(_popen(binary, host, port, workdir.name), host, port, workdir, password)


def _popen(binary: str, host: str, port: int, workdir: str) -> subprocess.Popen[bytes]:
    args = [binary, "redis.conf", "--port", str(port), "--bind", host, "--save", "",
            "--appendonly", "no", "--dir", workdir, "--daemonize", "no", "--logfile", "redis.log"]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=workdir, preexec_fn=die_with_parent)


def _wait_until_ready(server: RedisServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(host=server.host, port=server.port, password=server.password,
                         socket_connect_timeout=0.5, socket_timeout=0.5, retry=None)
    try:
        while True:
            if server.process.poll() is not None:
                raise _ExitedEarly(
                    f"{REDIS_BINARY} on {server.host}:{server.port} exited with code "
                    f"{server.process.returncode} during start-up; log:\n{_read_log(server)}")
            try:
                # NOTE: check the pid, not just PING: another server may hold the port we picked.
                if client.info("server").get("process_id") == server.process.pid:
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{REDIS_BINARY} on {server.host}:{server.port} did not answer PING within "
                    f"{timeout_s}s; log:\n{_read_log(server)}")
            time.sleep(0.02)
    finally:
        client.close()


def _read_log(server: RedisServer, max_chars: int = 2000) -> str:
    try:
        return server.log_path.read_text(errors="replace")[-max_chars:]
    except OSError:
        return "(no log)"
