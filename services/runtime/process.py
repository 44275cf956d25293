"""Child-process hygiene shared by ``tandem up`` and the throwaway redis-server: spawning,
stopping, and the ports and listeners they need."""
from __future__ import annotations

import asyncio
import ctypes
import logging
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
