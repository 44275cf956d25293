"""services.ports: listening ports are drawn below the kernel's ephemeral range (the project's CI
machines refuse some loopback ports inside it), and a port taken between the pick and the bind
is replaced."""
from __future__ import annotations

import socket

import pytest

from services import ports


def test_port_zero_listens_below_the_ephemeral_range():
    low = ports._ephemeral_low()
    for _ in range(20):
        sock = ports.listen(lambda p: socket.create_server(("127.0.0.1", p)), "127.0.0.1", 0)
        with sock:
            assert 1024 <= sock.getsockname()[1] < low
            with socket.create_connection(sock.getsockname(), timeout=5):
                pass  # reachable


def test_a_port_taken_meanwhile_is_replaced_and_a_named_port_is_not(monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = taken.getsockname()[1]
        picks = iter([busy, busy])
        monkeypatch.setattr(ports, "free_port", lambda host: next(picks, 0))  # then the OS picks
        tried = []

        def bind(p):
            tried.append(p)
            return socket.create_server(("127.0.0.1", p))

        with ports.listen(bind, "127.0.0.1", 0) as sock:
            assert tried[:2] == [busy, busy] and sock.getsockname()[1] != busy
        with pytest.raises(OSError):
            ports.listen(bind, "127.0.0.1", busy)
        assert tried[-1] == busy


def test_gives_up_after_the_tries(monkeypatch):
    def refuse(p):
        raise OSError(98, "Address already in use")

    with pytest.raises(OSError, match="in use"):
        ports.listen(refuse, "127.0.0.1", 0, tries=3)
