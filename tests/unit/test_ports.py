"""services.ports: listening ports are drawn below the kernel's ephemeral range (the project's CI
machines refuse some loopback ports inside it), a port taken between the pick and the bind
is replaced, and a port handed out for a child to bind later is never one that a server
binding at once may draw, nor one handed out just before."""
from __future__ import annotations

import socket

import pytest

from services import ports


def test_port_zero_listens_below_the_ephemeral_range_in_the_half_free_port_never_gives():
    (later_low, later_high), (now_low, now_high) = ports._halves()
    assert later_high == now_low and now_high == ports._ephemeral_low()
    for _ in range(20):
        sock = ports.listen(lambda p: socket.create_server(("127.0.0.1", p)), "127.0.0.1", 0)
        with sock:
            assert now_low <= sock.getsockname()[1] < now_high
            with socket.create_connection(sock.getsockname(), timeout=5):
                pass  # reachable
    for _ in range(20):
        assert later_low <= ports.free_port("127.0.0.1") < later_high
        assert now_low <= ports.listen_port("127.0.0.1") < now_high


def test_free_port_does_not_hand_out_a_recent_pick_again(monkeypatch):
    low, _ = ports._halves()[0]
    draws = iter([low + 7, low + 7, low + 7, low + 9])
    monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(draws))
    monkeypatch.setattr(ports, "_bindable", lambda host, port: True)
    monkeypatch.setattr(ports, "_recent", ports.deque(maxlen=ports.RECENT_PICKS))
    assert ports.free_port("127.0.0.1") == low + 7
    assert ports.free_port("127.0.0.1") == low + 9  # the two draws of low + 7 are passed over


def test_a_port_taken_meanwhile_is_replaced_and_a_named_port_is_not(monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = taken.getsockname()[1]
        picks = iter([busy, busy])
        monkeypatch.setattr(ports, "listen_port", lambda host: next(picks, 0))  # then the OS picks
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
