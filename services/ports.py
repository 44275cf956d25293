"""Ports to listen on: drawn below the kernel's ephemeral range instead of by ``bind(0)``.

Why not let the OS pick (port 0): the OS draws from the ephemeral range
(``ip_local_port_range``), where outgoing connections take their local ports too, and the
project's CI machines refuse loopback connections to five ports of that range (33131, 34387,
35051, 36743, 42017) whatever listens on them: a server bound there looks up and is
unreachable. Below the range neither happens. ``free_port`` picks one for a child process to
bind later; ``listen`` binds one now, trying another when it was taken meanwhile.
"""
from __future__ import annotations

import random
import socket
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
LISTEN_TRIES = 16


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now, drawn at random below the ephemeral range (so no
    outgoing connection can take it before the caller binds it). Falls back to the OS's pick
    when no port below the range is free."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(max(1024, low - 12000), low)
        if _bindable(host, port):
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen(bind: Callable[[int], T], host: str, port: int, tries: int = LISTEN_TRIES) -> T:
    """``bind(port)``; for ``port`` 0, ``bind(p)`` with ``p`` from ``free_port(host)``, again
    with another while it raises OSError (taken between the check and the bind). Returns what
    ``bind`` returns. Raises the last OSError after ``tries`` attempts, or at once for a
    port the caller named."""
    if port:
        return bind(port)
    for _ in range(tries - 1):
        try:
            return bind(free_port(host))
        except OSError:
            continue
    return bind(free_port(host))


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
