"""Contract tests of every KVTransport backend: the whole suite runs on TCP and on NIXL
(NIXL's cases skip only when no NIXL package is installed; an installed one that does not load
fails them).

Transports talk over 127.0.0.1 only. Receivers start filled with random data, so a block that
changes when it should not, or a write that misses, shows up as a mismatch.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time

import pytest
import torch

from services.engine.config import KVCacheLayout
from services.kv_transfer import (
    KVLayoutMismatchError, KVTransferError, KVTransport, create_transport,
)
from services.kv_transfer.tcp import TcpKVTransport
from services.kv_transfer.transport import MAX_NOTIFICATION_BYTES
from tests.unit.nixl_install import require_nixl

BACKENDS = ["tcp", "nixl"]
LAYOUT = KVCacheLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
TIMEOUT_S = 5.0
# NOTE: a bound on a wait that the code under test must end by itself (its own timeout, a
# close). Generous on purpose: what it tells apart is "ended" from "still blocked on a handler
# held for HELD_S", never fast from slow, so a loaded machine cannot fail it.
HANG_S = 10.0
HELD_S = 120.0
needs_nixl = pytest.mark.usefixtures("nixl_required")


@pytest.fixture
def nixl_required():
    """Skip when NIXL is not installed; fail when it is but does not load."""
    require_nixl()


@pytest.fixture(autouse=True)
def _nixl_cases_require_nixl(request):
    """A case parametrized with the "nixl" backend: as ``nixl_required``."""
    callspec = getattr(request.node, "callspec", None)
    if callspec and "nixl" in callspec.params.values():
        require_nixl()


def run_in_thread(fn) -> tuple[threading.Thread, list[BaseException]]:
    """Start ``fn()`` on a thread; the list collects what it raised."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - collected for the test
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.01)


def make_cache(layout: KVCacheLayout, num_blocks: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads,
             layout.head_dim)
    return torch.randn(shape, generator=gen).to(layout.torch_dtype)


@pytest.fixture(params=[*BACKENDS, "tcp-staged", "tcp-direct"])
def make(request):
    """``make(num_blocks, layout=LAYOUT, seed=0) -> (transport, kv_cache)``; closes all after.

    "tcp-staged": TCP through host staging buffers, the path of a GPU cache, forced on a CPU
    cache (gather -> host copy -> socket -> host buffer -> scatter). "tcp-direct": TCP's
    direct writes (the sender copies into the receiver's cache after the receiver admits the
    write: CUDA IPC between processes on a GPU), here within one process on CPU caches."""
    made: list[KVTransport] = []
    backend = request.param.split("-")[0]

    def _make(num_blocks: int, layout: KVCacheLayout = LAYOUT, seed: int = 0):
        cache = make_cache(layout, num_blocks, seed)
        if request.param == "tcp-direct":
            transport = TcpKVTransport(cache, layout, host="127.0.0.1", port=0,
                                       direct_writes=True)
        else:
            transport = create_transport(backend, cache, layout, host="127.0.0.1", port=0)
        if request.param.endswith("-staged"):
            transport._staged, transport._memory = True, None
        made.append(transport)
        return transport, cache

    yield _make
    for transport in made:
        transport.close()


def make_pair(make, sender_blocks: int = 20, receiver_blocks: int = 13):
    sender, src = make(sender_blocks, seed=1)
    receiver, dst = make(receiver_blocks, seed=2)
    notes: list[bytes] = []
    receiver.set_notification_handler(notes.append)
    peer = sender.add_remote(receiver.metadata())
    if isinstance(sender, TcpKVTransport):  # direct writes are used exactly where offered
        assert sender.direct_peers() == ([peer] if sender._direct else [])
    return sender, src, receiver, dst, notes, peer


def assert_landed(src, dst, before, local_ids, remote_ids) -> None:
    """Written blocks equal their sources bit for bit; every other remote block is unchanged."""
    expected = before.clone()
    expected[:, :, remote_ids] = src[:, :, local_ids]
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("local_ids, remote_ids", [
    ([0, 1, 2, 3], [5, 6, 7, 8]),  # contiguous on both sides
    ([19, 3, 7, 8, 9, 0], [2, 12, 0, 1, 4, 11]),  # scattered, unordered, mixed runs
    ([4, 5, 6], [12, 11, 10]),  # contiguous locally, descending remotely
    ([7], [0]),
])
def test_blocks_land_bit_exact_and_nothing_else_changes(make, local_ids, remote_ids):
    sender, src, receiver, dst, notes, peer = make_pair(make)
    before = dst.clone()
    sender.write_blocks(peer, local_ids, remote_ids, b"req-1", TIMEOUT_S)
    assert_landed(src, dst, before, local_ids, remote_ids)
    assert notes == [b"req-1"]


@pytest.mark.parametrize("layer_starts", [(2, 0, 4), (0, 0, 0), (4, 4, 4), (1, 3, 2)])
def test_layer_starts_leave_each_layer_s_earlier_blocks_untouched(make, layer_starts):
    """A write with ``layer_starts`` (Gemma: a sliding layer skips the blocks before its window,
    the global layers take them all): layer ``l`` lands only from position ``layer_starts[l]``
    of the lists on; everything else in the receiver keeps its bytes, and the payload bytes
    returned and counted are exactly those."""
    sender, src, receiver, dst, notes, peer = make_pair(make)
    local_ids, remote_ids = [19, 3, 7, 8], [2, 12, 0, 1]
    before, received = dst.clone(), receiver.bytes_received
    sent = sender.write_blocks(peer, local_ids, remote_ids, b"gemma", TIMEOUT_S,
                               layer_starts=layer_starts)
    expected = before.clone()
    for layer, start in enumerate(layer_starts):
        expected[layer, :, remote_ids[start:]] = src[layer, :, local_ids[start:]]
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))
    pairs = sum(len(local_ids) - s for s in layer_starts)
    assert sent == pairs * 2 * LAYOUT.block_bytes == receiver.bytes_received - received
    assert notes == [b"gemma"]


@pytest.mark.parametrize("layer_starts", [(0, 0), (0, 0, 5), (0, -1, 0), (0, 1.0, 0)])
def test_malformed_layer_starts_are_refused_before_sending(make, layer_starts):
    sender, src, receiver, dst, notes, peer = make_pair(make)
    before = dst.clone()
    with pytest.raises(ValueError, match="layer_starts"):
        sender.write_blocks(peer, [1, 2, 3, 4], [5, 6, 7, 8], b"", TIMEOUT_S,
                            layer_starts=layer_starts)
    assert torch.equal(dst, before) and notes == []


def test_bfloat16_cache_round_trips(make):
    layout = dataclasses.replace(LAYOUT, dtype="bfloat16")
    sender, src = make(6, layout, seed=3)
    receiver, dst = make(9, layout, seed=4)
    receiver.set_notification_handler(lambda note: None)
    before = dst.clone()
    sender.write_blocks(sender.add_remote(receiver.metadata()), [5, 0], [8, 3], b"", TIMEOUT_S)
    assert_landed(src, dst, before, [5, 0], [8, 3])


def test_notification_once_per_write_and_after_data(make):
    sender, src = make(20, seed=1)
    receiver, dst = make(13, seed=2)
    seen: list[tuple[bytes, bool]] = []
    writes = [([1, 2], [3, 4], b"a"), ([9], [0], b"\x00bin\xff"), ([], [], b"only-note")]

    def handler(note: bytes) -> None:
        local, remote, _ = next(w for w in writes if w[2] == note)
        seen.append((note, torch.equal(dst[:, :, remote], src[:, :, local])))

    receiver.set_notification_handler(handler)
    peer = sender.add_remote(receiver.metadata())
    for local, remote, note in writes:
        sender.write_blocks(peer, local, remote, note, TIMEOUT_S)
    assert seen == [(note, True) for _, _, note in writes]


def test_add_remote_is_idempotent(make):
    sender, _, receiver, _, _, peer = make_pair(make)
    assert sender.add_remote(receiver.metadata()) == peer


def test_concurrent_senders_into_one_receiver(make):
    receiver, dst = make(64, seed=9)
    notes: list[bytes] = []
    lock = threading.Lock()
    receiver.set_notification_handler(lambda n: (lock.acquire(), notes.append(n), lock.release()))
    before = dst.clone()
    senders = [make(16, seed=10 + s) for s in range(3)]
    plan = [(s, w, list(range(w * 4, w * 4 + 4)), [s * 20 + w * 4 + k for k in (3, 0, 1, 2)])
            for s in range(3) for w in range(4)]  # disjoint remote ids per write
    errors: list[BaseException] = []

    def run(s: int) -> None:
        transport, _ = senders[s]
        try:
            peer = transport.add_remote(receiver.metadata())
            for _, w, local, remote in (p for p in plan if p[0] == s):
                transport.write_blocks(peer, local, remote, f"{s}-{w}".encode(), TIMEOUT_S)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(3)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert not errors
    assert sorted(notes) == sorted(f"{s}-{w}".encode() for s, w, _, _ in plan)
    expected = before.clone()
    for s, _, local, remote in plan:
        expected[:, :, remote] = senders[s][1][:, :, local]
    assert torch.equal(dst, expected)


def test_concurrent_writes_from_one_sender_to_one_peer(make):
    sender, src, receiver, dst, notes, peer = make_pair(make, 20, 20)
    before = dst.clone()
    jobs = [([i], [19 - i], str(i).encode()) for i in range(12)]
    threads = [threading.Thread(target=sender.write_blocks, args=(peer, *job, TIMEOUT_S))
               for job in jobs]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert sorted(notes) == sorted(job[2] for job in jobs)
    assert_landed(src, dst, before, [j[0][0] for j in jobs], [j[1][0] for j in jobs])


@pytest.mark.parametrize("changes", [
    {"block_size": 8}, {"dtype": "float16"}, {"num_layers": 4}, {"num_kv_heads": 1},
    {"head_dim": 16}, {"block_size": 8, "dtype": "bfloat16"},
])
def test_layout_mismatch_names_every_field(make, changes):
    sender, _ = make(8)
    receiver, _ = make(8, dataclasses.replace(LAYOUT, **changes))
    with pytest.raises(KVLayoutMismatchError) as info:
        sender.add_remote(receiver.metadata())
    assert set(info.value.fields) == set(changes)
    for field in changes:
        assert field in str(info.value)


def test_out_of_range_remote_ids_refused_and_receiver_keeps_working(make):
    sender, src, receiver, dst, notes, peer = make_pair(make, 20, 13)
    before = dst.clone()
    for bad in ([0, 13], [-1], [2, 99]):
        with pytest.raises(KVTransferError, match="out of range"):
            sender.write_blocks(peer, [0, 1][:len(bad)], bad, b"bad", TIMEOUT_S)
    assert torch.equal(dst, before) and notes == []
    sender.write_blocks(peer, [4, 5], [12, 0], b"good", TIMEOUT_S)
    assert_landed(src, dst, before, [4, 5], [12, 0])
    assert notes == [b"good"]


@pytest.mark.parametrize("local_ids, remote_ids", [([0, 1], [0]), ([20], [0]), ([-1], [0]),
                                                   ([1, 1], [2, 3]), ([1, 2], [3, 3])])
def test_bad_local_arguments_raise_value_error(make, local_ids, remote_ids):
    sender, _, _, _, notes, peer = make_pair(make, 20, 13)
    with pytest.raises(ValueError):
        sender.write_blocks(peer, local_ids, remote_ids, b"x", TIMEOUT_S)
    assert notes == []


def test_oversized_notification_raises_value_error(make):
    sender, _, _, _, notes, peer = make_pair(make, 20, 13)
    with pytest.raises(ValueError, match="notification of"):
        sender.write_blocks(peer, [0], [0], b"x" * (MAX_NOTIFICATION_BYTES + 1), TIMEOUT_S)
    sender.write_blocks(peer, [0], [0], b"x" * MAX_NOTIFICATION_BYTES, TIMEOUT_S)
    assert [len(n) for n in notes] == [MAX_NOTIFICATION_BYTES]


def test_unknown_peer_raises(make):
    sender, _ = make(4)
    with pytest.raises(KVTransferError, match="unknown peer"):
        sender.write_blocks("nobody", [0], [0], b"x", TIMEOUT_S)


def test_handler_error_and_missing_handler_reach_the_sender(make):
    sender, _ = make(8, seed=1)
    receiver, _ = make(8, seed=2)
    peer = sender.add_remote(receiver.metadata())
    with pytest.raises(KVTransferError, match="handler"):
        sender.write_blocks(peer, [0], [0], b"x", TIMEOUT_S)

    def failing(note: bytes) -> None:
        raise RuntimeError("scheduler is full")

    receiver.set_notification_handler(failing)
    with pytest.raises(KVTransferError, match="scheduler is full"):
        sender.write_blocks(peer, [0], [0], b"x", TIMEOUT_S)
    notes: list[bytes] = []
    receiver.set_notification_handler(notes.append)
    sender.write_blocks(peer, [1], [1], b"ok", TIMEOUT_S)
    assert notes == [b"ok"]


def test_dead_receiver_raises_instead_of_hanging(make):
    sender, _, receiver, _, _, peer = make_pair(make)
    receiver.close()

    def write_twice() -> None:
        with pytest.raises(KVTransferError):
            sender.write_blocks(peer, [0, 1], [0, 1], b"x", 2.0)
        with pytest.raises(KVTransferError):  # the next write dials a fresh connection: refused
            sender.write_blocks(peer, [0, 1], [0, 1], b"x", 2.0)

    thread, errors = run_in_thread(write_twice)
    thread.join(HANG_S)
    assert not thread.is_alive(), "a write to a closed receiver hangs"
    assert not errors, errors


def test_stuck_receiver_times_out_instead_of_hanging(make):
    sender, _, receiver, _, _, peer = make_pair(make)
    release = threading.Event()
    receiver.set_notification_handler(lambda note: release.wait(HELD_S))
    thread, errors = run_in_thread(lambda: sender.write_blocks(peer, [0], [0], b"x", 0.5))
    thread.join(HANG_S)  # without its own timeout the write would wait for the handler: HELD_S
    release.set()
    assert not thread.is_alive(), "the write waited for a stuck receiver past its timeout"
    assert len(errors) == 1 and isinstance(errors[0], KVTransferError), errors
    assert "timed out" in str(errors[0])


def kv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kv-")]


def test_close_is_clean_and_idempotent(make):
    sender, _, receiver, _, _, peer = make_pair(make)
    sender.write_blocks(peer, [0], [0], b"x", TIMEOUT_S)
    metadata = receiver.metadata()
    thread, errors = run_in_thread(lambda: (sender.close(), receiver.close(), receiver.close()))
    thread.join(HANG_S)
    assert not thread.is_alive() and not errors, errors
    with pytest.raises(KVTransferError):
        sender.write_blocks(peer, [0], [0], b"x", TIMEOUT_S)
    with pytest.raises(KVTransferError):
        sender.add_remote(metadata)
    wait_for(lambda: not kv_threads(), HANG_S, f"transport threads ended ({kv_threads()})")


def test_close_fails_an_in_flight_write_promptly(make):
    sender, _, receiver, _, _, peer = make_pair(make)
    entered, release = threading.Event(), threading.Event()
    receiver.set_notification_handler(lambda note: (entered.set(), release.wait(HELD_S)))
    thread, errors = run_in_thread(lambda: sender.write_blocks(peer, [0], [0], b"x", HELD_S))
    assert entered.wait(HANG_S), "the write never reached the receiver"  # in flight now
    sender.close()
    thread.join(HANG_S)  # without close failing it, the write would wait HELD_S for the handler
    release.set()
    assert not thread.is_alive(), "close left an in-flight write blocked"
    assert len(errors) == 1 and isinstance(errors[0], KVTransferError), errors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache, message", [
    (torch.zeros(3, 2, 4, 8, 2, 8), "block_size"),
    (torch.zeros(3, 2, 4, 4, 2, 8, dtype=torch.float16), "dtype"),
    (torch.zeros(2, 2, 4, 4, 2, 8), "num_layers"),
    (torch.zeros(3, 2, 4, 4, 2, 8).transpose(0, 2), "shape|contiguous"),
])
def test_cache_not_matching_layout_is_rejected(backend, cache, message):
    with pytest.raises(ValueError, match=message):
        create_transport(backend, cache, LAYOUT, host="127.0.0.1", port=0)


def test_create_transport_rejects_unknown_and_unavailable_backends(monkeypatch):
    cache = make_cache(LAYOUT, 2, 0)
    with pytest.raises(ValueError, match="tcp"):
        create_transport("carrier-pigeon", cache, LAYOUT, host="127.0.0.1", port=0)
    for module in ("nixl_cu13", "nixl_cu12", "nixl", "nixl._api"):  # None in sys.modules: import fails
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=r"not installed \(pip install nixl-cu13.*\).*tcp"):
        create_transport("nixl", cache, LAYOUT, host="127.0.0.1", port=0)


@pytest.mark.parametrize("backend, field", [("tcp", "head_dim"),
                                            ("nixl", "num_kv_heads")])
def test_receiver_refuses_mismatched_layout_at_handshake(backend, field):
    """Metadata that lies about the layout gets past the sender; the receiver still refuses."""
    sender = create_transport(backend, make_cache(LAYOUT, 4, 0), LAYOUT, host="127.0.0.1", port=0)
    other = dataclasses.replace(LAYOUT, **{field: 1})
    receiver = create_transport(backend, make_cache(other, 4, 0), other, host="127.0.0.1", port=0)
    try:
        forged = json.loads(receiver.metadata())
        forged["layout"] = dataclasses.asdict(LAYOUT)
        with pytest.raises(KVLayoutMismatchError, match=field) as info:
            sender.add_remote(json.dumps(forged).encode())
        assert info.value.fields == (field,)
        with pytest.raises(KVTransferError, match="unknown peer"):  # nothing was set up
            sender.write_blocks(forged["name"], [0], [0], b"x", TIMEOUT_S)
    finally:
        sender.close(), receiver.close()


# ---- TCP backend specifics -----------------------------------------------------------------

def test_tcp_metadata_reports_real_port_and_rejects_garbage():
    transport = create_transport("tcp", make_cache(LAYOUT, 2, 0), LAYOUT, host="127.0.0.1",
                                 port=0, advertise_host="decode-0.local")
    try:
        meta = json.loads(transport.metadata())
        assert meta["host"] == "decode-0.local" and meta["port"] > 0
        with pytest.raises(KVTransferError, match="invalid"):
            transport.add_remote(b"not json")
    finally:
        transport.close()


# ---- NIXL backend specifics ----------------------------------------------------------------

@needs_nixl
def test_nixl_rejects_garbage_and_other_backends_metadata():
    nixl = create_transport("nixl", make_cache(LAYOUT, 2, 0), LAYOUT, host="127.0.0.1", port=0)
    tcp = create_transport("tcp", make_cache(LAYOUT, 2, 0), LAYOUT, host="127.0.0.1", port=0)
    try:
        for metadata, message in ((b"not json", "invalid"), (b"{}", "invalid"),
                                  (tcp.metadata(), "uses backend 'tcp'")):
            with pytest.raises(KVTransferError, match=message):
                nixl.add_remote(metadata)
    finally:
        nixl.close(), tcp.close()


@needs_nixl
def test_nixl_two_workers_write_to_each_other():
    """One agent acts as sender and receiver at once: handshakes both ways, data both ways."""
    a = create_transport("nixl", make_cache(LAYOUT, 6, 1), LAYOUT, host="127.0.0.1", port=0)
    b = create_transport("nixl", make_cache(LAYOUT, 6, 2), LAYOUT, host="127.0.0.1", port=0)
    try:
        notes: list[bytes] = []
        a.set_notification_handler(notes.append)
        b.set_notification_handler(notes.append)
        a_to_b = a.add_remote(b.metadata())
        b_to_a = b.add_remote(a.metadata())
        before_a, before_b = a.kv_cache.clone(), b.kv_cache.clone()
        a.write_blocks(a_to_b, [0, 1], [4, 5], b"a->b", TIMEOUT_S)
        b.write_blocks(b_to_a, [2], [3], b"b->a", TIMEOUT_S)
        assert_landed(before_a, b.kv_cache, before_b, [0, 1], [4, 5])
        assert_landed(before_b, a.kv_cache, before_a, [2], [3])
        assert notes == [b"a->b", b"b->a"]
    finally:
        a.close(), b.close()
