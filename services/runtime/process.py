"""Child-process hygiene shared by ``tandem up`` and the throwaway redis-server: spawning,
stopping, and the ports and listeners they need."""
from __future__ import annotations

import asyncio
import ctypes
import logging
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """``preexec_fn`` for ``subprocess.Popen``: Linux sends the child SIGTERM when its parent
    dies, even by SIGKILL, so no worker or redis-server outlives ``tandem up`` or a test run.
    A no-op where prctl is missing (the parent's own shutdown still stops its children)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now, for a child to listen on.

    Drawn at random below the kernel's ephemeral range (``ip_local_port_range``), where no
    outgoing connection (to Redis, to a worker) can take it between this check and the child's
    bind, as one would if the OS picked it (``bind(0)`` draws from that very range). Falls back
    to the OS's pick when no port below the range is free."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(max(1024, low - 12000), low)
        if _bindable(host, port):
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start a child of ``tandem up`` (its own session; dies with its parent)."""
    # own session: a terminal's Ctrl-C reaches only us, and we stop children in order;
    # the parent-death signal ends a child even if we are killed with SIGKILL
    return subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent, env=env)


def terminate(procs: list[tuple[str, subprocess.Popen]], timeout_s: float) -> None:
    """SIGTERM each live process, wait for all within ``timeout_s``, SIGKILL the rest."""
    for _, proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for name, proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0fs: killing it", name, timeout_s)
            proc.kill()
            proc.wait()


async def listening(host: str, port: int) -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    return await _connect(host, port, 1.0) is True


async def refuses_connections(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """True when a TCP connection to ``host:port`` is refused: nothing listens there. False
    when it is accepted, and when the attempt fails otherwise (timeout, unreachable host):
    those prove nothing about the listener."""
    return await _connect(host, port, timeout_s) is False


async def _connect(host: str, port: int, timeout_s: float) -> bool | None:
    """One TCP connection attempt, closed at once: True accepted, False refused, None neither."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=timeout_s)
    except ConnectionRefusedError:
        return False
    except (OSError, asyncio.TimeoutError):
        return None
    writer.close()
    return True


@dataclass
class Child:
    """One supervised child process; ``restart()`` runs the same argv again."""
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen

    def exit_code(self) -> int | None:
        return self.proc.poll()  # reaps it

    def restart(self) -> None:
        self.proc = spawn(self.argv, self.env)
