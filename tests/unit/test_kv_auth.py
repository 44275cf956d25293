"""KV transfer authorisation (issue 10): a receiver with ``require_grants`` admits one write per
granted token, only into that grant's block ids, only before its lease ends; handshakes prove
the internal secret. Both backends; on TCP a refused write leaves the cache bit-identical (on
NIXL a one-sided WRITE lands before the receiver can refuse it, so there it is only never
acted on: no handler runs, the sender is told).
"""
from __future__ import annotations

import contextlib
import json
import socket
import time

import pytest
import torch

from services.kv_transfer import KVLeaseRefusedError, KVTransferError, create_transport
from services.kv_transfer.grants import new_token
from services.kv_transfer.tcp import TcpKVTransport
from services.kv_transfer.tcp_wire import recv_frame, send_frame
from tests.unit.test_kv_transfer import BACKENDS, LAYOUT, TIMEOUT_S, make_cache

SECRET = "s3cret-s3cret-s3cret"
GRANTED = [3, 4, 9]  # the reservation's blocks on the receiver


@pytest.fixture(params=[*BACKENDS, "tcp-direct"])
def backend(request) -> str:
    """"tcp-direct": TCP's direct writes (``services.kv_transfer.direct``), in one process."""
    return request.param


@pytest.fixture
def made():
    transports = []
    yield transports
    for t in transports:
        t.close()


def make(backend: str, made: list, seed: int, secret: str | None = SECRET, grants: bool = True):
    if backend == "tcp-direct":
        t = TcpKVTransport(make_cache(LAYOUT, 12, seed), LAYOUT, host="127.0.0.1", port=0,
                           secret=secret, require_grants=grants, direct_writes=True)
    else:
        t = create_transport(backend, make_cache(LAYOUT, 12, seed), LAYOUT, host="127.0.0.1",
                             port=0, secret=secret, require_grants=grants)
    made.append(t)
    return t


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def granted_pair(backend: str, made: list, lease_s: float = 30.0):
    sender, receiver = make(backend, made, 1), make(backend, made, 2)
    notes: list[bytes] = []
    token = new_token()
    receiver.grant_write(token, GRANTED, lease_s, notes.append)
    return sender, receiver, sender.add_remote(receiver.metadata()), token, notes


def test_forged_writes_are_refused_and_touch_nothing(backend, made):
    sender, receiver, peer, token, notes = granted_pair(backend, made)
    before = receiver.kv_cache.clone()
    forged = [
        (GRANTED, b""),  # no token
        (GRANTED, new_token()),  # a token nobody granted
        ([3, 4, 10], token),  # the right token, other block ids
        ([3, 4], token),  # the right token, part of the blocks
    ]
    for ids, tok in forged:
        with pytest.raises(KVTransferError, match="refused"):
            sender.write_blocks(peer, [0, 1, 2][:len(ids)], ids, b"forged", TIMEOUT_S, token=tok)
    assert notes == []
    if backend == "tcp":  # NIXL: one-sided WRITEs land before any check (module doc)
        assert torch.equal(receiver.kv_cache.view(torch.uint8), before.view(torch.uint8))
    sender.write_blocks(peer, [0, 1, 2], GRANTED, b"real", TIMEOUT_S, token=token)
    assert notes == [b"real"]
    assert torch.equal(receiver.kv_cache[:, :, GRANTED], sender.kv_cache[:, :, [0, 1, 2]])


def test_a_token_admits_one_write_only(backend, made):
    sender, receiver, peer, token, notes = granted_pair(backend, made)
    sender.write_blocks(peer, [0, 1, 2], GRANTED, b"first", TIMEOUT_S, token=token)
    after_first = receiver.kv_cache.clone()
    with pytest.raises(KVTransferError, match="already used"):
        sender.write_blocks(peer, [5, 6, 7], GRANTED, b"second", TIMEOUT_S, token=token)
    with pytest.raises(KVTransferError, match="already used"):
        sender.write_blocks(peer, [], [], b"note", TIMEOUT_S, token=token)
    assert notes == [b"first"]
    if backend == "tcp":
        assert torch.equal(receiver.kv_cache.view(torch.uint8), after_first.view(torch.uint8))


def test_notification_only_close_uses_the_token(backend, made):
    sender, _, peer, token, notes = granted_pair(backend, made)
    sender.write_blocks(peer, [], [], b"not_written", TIMEOUT_S, token=token)
    assert notes == [b"not_written"]


def test_write_after_the_lease_is_refused_and_renewal_cannot_revive_it(backend, made):
    sender, receiver, peer, token, notes = granted_pair(backend, made, lease_s=0.3)
    before = receiver.kv_cache.clone()
    wait_until(lambda: receiver.lease_left(token) == 0)
    with pytest.raises(KVTransferError, match="lease"):
        sender.renew_lease(peer, token, TIMEOUT_S)
    with pytest.raises(KVTransferError, match="lease has ended"):
        sender.write_blocks(peer, [0, 1, 2], GRANTED, b"late", TIMEOUT_S, token=token)
    assert notes == []
    if backend == "tcp":
        assert torch.equal(receiver.kv_cache.view(torch.uint8), before.view(torch.uint8))


def test_renewal_extends_the_lease_and_needs_the_token(backend, made):
    sender, receiver, peer, token, notes = granted_pair(backend, made, lease_s=30.0)
    receiver.receiver.grants._grants[token].expires_at = time.monotonic() + 1.0  # nearly over
    assert sender.renew_lease(peer, token, TIMEOUT_S) == 30.0
    assert receiver.lease_left(token) > 20.0
    with pytest.raises(KVTransferError, match="refused the lease renewal"):
        sender.renew_lease(peer, new_token(), TIMEOUT_S)
    receiver.revoke(token)
    assert receiver.lease_left(token) == 0
    with pytest.raises(KVTransferError, match="refused"):
        sender.write_blocks(peer, [0, 1, 2], GRANTED, b"revoked", TIMEOUT_S, token=token)
    assert notes == []


def test_grant_arguments_are_checked(backend, made):
    receiver = make(backend, made, 2)
    with pytest.raises(ValueError, match="token"):
        receiver.grant_write(b"short", [0], 1.0, lambda n: None)
    with pytest.raises(ValueError, match="block_ids"):
        receiver.grant_write(new_token(), [12], 1.0, lambda n: None)
    with pytest.raises(ValueError, match="lease_s"):
        receiver.grant_write(new_token(), [0], 0.0, lambda n: None)
    token = new_token()
    receiver.grant_write(token, [0], 1.0, lambda n: None)
    with pytest.raises(ValueError, match="already granted"):
        receiver.grant_write(token, [1], 1.0, lambda n: None)


@pytest.mark.parametrize("sender_secret, receiver_secret", [
    (None, SECRET), ("wrong-wrong-wrong-wrong", SECRET), (SECRET, None),
])
def test_handshake_needs_the_same_secret_on_both_ends(backend, made, sender_secret, receiver_secret):
    sender = make(backend, made, 1, secret=sender_secret)
    receiver = make(backend, made, 2, secret=receiver_secret)
    token = new_token()
    notes: list[bytes] = []
    receiver.grant_write(token, GRANTED, 30.0, notes.append)
    with pytest.raises(KVTransferError, match="secret"):
        sender.add_remote(receiver.metadata())
    with pytest.raises(KVTransferError, match="unknown peer|closed"):  # nothing was set up
        sender.write_blocks(json.loads(receiver.metadata())["name"], [0, 1, 2], GRANTED, b"x",
                            TIMEOUT_S, token=token)
    assert notes == []


def test_without_grants_the_receiver_behaves_as_before(backend, made):
    sender = make(backend, made, 1, secret=None, grants=False)
    receiver = make(backend, made, 2, secret=None, grants=False)
    notes: list[bytes] = []
    receiver.set_notification_handler(notes.append)
    sender.write_blocks(sender.add_remote(receiver.metadata()), [0], [5], b"open", TIMEOUT_S)
    assert notes == [b"open"]


def test_a_refused_notification_reports_the_write_lost(backend, made):
    """The receiver's own handler refuses the note (e.g. it names another request): the
    reservation must hear that its write is over, or its lease would wait on it forever."""
    sender, receiver = make(backend, made, 1), make(backend, made, 2)
    lost: list[str] = []

    def refuse(note: bytes) -> None:
        raise ValueError("names another request")

    token = new_token()
    receiver.grant_write(token, GRANTED, 0.5, refuse, lost.append)
    peer = sender.add_remote(receiver.metadata())
    with pytest.raises(KVTransferError, match="names another request"):
        sender.write_blocks(peer, [0, 1, 2], GRANTED, b"x", TIMEOUT_S, token=token)
    assert len(lost) == 1 and "names another request" in lost[0]
    wait_until(lambda: receiver.lease_left(token) == 0)  # the lease still ends


def test_a_detached_reservation_is_not_renewed_but_may_still_be_written(backend, made):
    """Its stream went away: the lease runs out instead of being renewed (the sender learns
    that nothing it computes will be used), yet a write under way may still land."""
    sender, receiver, peer, token, notes = granted_pair(backend, made)
    receiver.stop_renewals(token)
    with pytest.raises(KVLeaseRefusedError):
        sender.renew_lease(peer, token, TIMEOUT_S)
    sender.write_blocks(peer, [0, 1, 2], GRANTED, b"landed", TIMEOUT_S, token=token)
    assert notes == [b"landed"]


@contextlib.contextmanager
def handshaken(meta: dict):
    """A raw connection to a TCP receiver (its ``metadata()`` as a dict) past the handshake
    (no secret): ``(socket, deadline)``, closed after the block."""
    deadline = time.monotonic() + TIMEOUT_S
    with socket.create_connection((meta["host"], meta["port"]), timeout=TIMEOUT_S) as sock:
        recv_frame(sock, deadline)  # the challenge
        send_frame(sock, {"op": "hello", "layout": meta["layout"], "nonce": "n", "proof": ""},
                   deadline)
        assert recv_frame(sock, deadline)["ok"]
        yield sock, deadline


def test_tcp_write_that_breaks_off_mid_payload_is_reported_lost(made):
    """A sender that dies mid-payload: the receiver knows nothing more of the write can land
    and closes the reservation at once (``on_lost``), instead of waiting for the lease."""
    receiver = make("tcp", made, 2, secret=None)
    token, lost, notes = new_token(), [], []
    receiver.grant_write(token, GRANTED, 30.0, notes.append, lost.append)
    with handshaken(json.loads(receiver.metadata())) as (sock, deadline):
        payload = len(GRANTED) * LAYOUT.num_layers * 2 * LAYOUT.block_bytes
        send_frame(sock, {"op": "write", "remote_block_ids": GRANTED, "token": token.hex(),
                          "notif_len": 0, "payload_bytes": payload, "timeout_s": 5.0},
                   deadline, [memoryview(bytes(payload // 2))])
    wait_until(lambda: lost)
    assert notes == [] and "broke off" in lost[0]
    assert receiver.receiver.grants.admit(token, GRANTED) == (None, "the token was already used")


@pytest.mark.parametrize("direct_offered", [True, False])
def test_tcp_direct_write_whose_sender_never_reports_landing_is_lost(made, direct_offered):
    """A direct write: the receiver says go only after admitting it, and a sender that then
    goes away without reporting the copy landed costs the reservation at once (``on_lost``),
    not silently. A receiver that offers no direct writes refuses one, touching nothing."""
    receiver = TcpKVTransport(make_cache(LAYOUT, 12, 2), LAYOUT, host="127.0.0.1", port=0,
                              require_grants=True, direct_writes=direct_offered)
    made.append(receiver)
    token, lost, notes = new_token(), [], []
    receiver.grant_write(token, GRANTED, 30.0, notes.append, lost.append)
    meta = json.loads(receiver.metadata())
    assert (meta["direct"] is not None) == direct_offered
    with handshaken(meta) as (sock, deadline):
        payload = len(GRANTED) * LAYOUT.num_layers * 2 * LAYOUT.block_bytes
        send_frame(sock, {"op": "write", "direct": True, "remote_block_ids": GRANTED,
                          "token": token.hex(), "notif_len": 0, "payload_bytes": payload,
                          "timeout_s": 5.0}, deadline)
        reply = recv_frame(sock, deadline)
        if not direct_offered:
            assert reply == {"ok": False, "error": "this receiver does not offer direct writes"}
            assert receiver.receiver.grants.lease_left(token) > 0  # still open for a real write
            return
        assert reply == {"ok": True, "go": True}
    wait_until(lambda: lost)
    assert notes == [] and "broke off" in lost[0]
    assert receiver.receiver.grants.admit(token, GRANTED) == (None, "the token was already used")
