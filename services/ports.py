"""Ports to listen on: drawn below the kernel's ephemeral range instead of by ``bind(0)``.

Why not let the OS pick (port 0): the OS draws from the ephemeral range
(``ip_local_port_range``), where outgoing connections take their local ports too, and the
project's CI machines refuse loopback connections to five ports of that range (33131, 34387,
35051, 36743, 42017) whatever listens on them: a server bound there looks up and is
unreachable. Below the range neither happens.

Two kinds of pick, from two halves of the 12,000 ports below the range, so that neither takes
the other's:

- ``free_port``: a port for a child process to bind later (``tandem up``'s /metrics ports, a
  test's gateway port). It is free when drawn, but nothing holds it until the child binds it,
  seconds later. The lower half, and never a port this process handed out in its last
  ``RECENT_PICKS`` picks.
- ``listen`` (and ``listen_port`` for a server that binds and retries itself, such as
  redis-server): a port bound at once, trying another when it was taken meanwhile. The upper
  half. A fresh-clone CI run once failed because a worker, binding its own gRPC or KV port
  from the same range as a test's picks, took the HTTP port a test had drawn for its gateway
  (``[Errno 98] address already in use`` in the gateway's start): with the halves apart, a
  port bound at once cannot be one handed out for later.
"""
from __future__ import annotations

import random
import socket
from collections import deque
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
LISTEN_TRIES = 16
SPAN = 12000  # ports below the ephemeral range that we draw from, in two halves
RECENT_PICKS = 256  # free_port's picks that it does not hand out again

_recent: deque[int] = deque(maxlen=RECENT_PICKS)


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now, for another process to bind later: drawn at random from
    the lower half of the ports below the ephemeral range (no outgoing connection and no
    ``listen`` takes it before the caller binds it), and not one of this process's last
    ``RECENT_PICKS`` picks (two picks in a row are two ports). Falls back to the OS's pick when
    none is free."""
    low, high = _halves()[0]
    port = _draw(host, low, high, exclude=set(_recent))
    _recent.append(port)
    return port


def listen_port(host: str) -> int:
    """A TCP port free on ``host`` now, for the caller to bind at once (and to draw again if it
    was taken meanwhile): drawn at random from the upper half of the ports below the ephemeral
    range, which ``free_port`` never hands out. Falls back to the OS's pick when none is free."""
    low, high = _halves()[1]
    return _draw(host, low, high)


def listen(bind: Callable[[int], T], host: str, port: int, tries: int = LISTEN_TRIES) -> T:
    """``bind(port)``; for ``port`` 0, ``bind(p)`` with ``p`` from ``listen_port(host)``, again
    with another while it raises OSError (taken between the check and the bind). Returns what
    ``bind`` returns. Raises the last OSError after ``tries`` attempts, or at once for a
    port the caller named."""
    if port:
        return bind(port)
    for _ in range(tries - 1):
        try:
            return bind(listen_port(host))
        except OSError:
            continue
    return bind(listen_port(host))


def _halves() -> tuple[tuple[int, int], tuple[int, int]]:
    """((low, high) of ``free_port``'s half, (low, high) of ``listen_port``'s), high exclusive."""
    top = _ephemeral_low()
    bottom = max(1024, top - SPAN)
    middle = (bottom + top) // 2
    return (bottom, middle), (middle, top)


def _draw(host: str, low: int, high: int, exclude: set[int] = frozenset()) -> int:
    for _ in range(64 if high > low else 0):
        port = random.randrange(low, high)
        if port not in exclude and _bindable(host, port):
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
