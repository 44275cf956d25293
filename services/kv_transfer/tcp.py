"""Pure-Python TCP backend of ``KVTransport``: no extra dependencies.

Wire protocol (every frame: 4-byte big-endian length + UTF-8 JSON):
- handshake: sender ``{"op": "hello", "layout"}`` -> receiver ``{"ok", "name", "layout",
  "num_blocks"}`` or ``{"ok": false, "error", "fields"}``; both sides compare layouts.
- write: sender ``{"op": "write", "remote_block_ids", "notif_len", "payload_bytes",
  "timeout_s"}``, then the notification bytes, then the payload in layer-major order
  (layer, K then V, blocks in list order) -> receiver ``{"ok": true}`` or ``{"ok": false,
  "error"}``. The receiver ``recvmsg_into``s the payload straight into its cache's memory; the
  sender ``sendmsg``s views of its cache; each side coalesces runs of consecutive block ids.
  NOTE: measured faster than gathering the blocks into one buffer first (no extra copy).
- A cache on a GPU cannot be a socket buffer: it is staged through host memory. The sender
  gathers the blocks on the device (``gather_blocks``, the Triton kernel on CUDA) and sends
  one host copy; the receiver fills a host buffer and scatters it into its cache. The wire is
  the same, so a GPU worker and a CPU worker interoperate.
"""
from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
import time
import uuid
from collections.abc import Sequence

import torch

from kernels.block_copy import gather_blocks, scatter_blocks
from kernels.kv_layout import KVCacheLayout
from services.kv_transfer.base import (
    MAX_NOTIFICATION_BYTES, KVLayoutMismatchError, KVTransferError, KVTransport,
    NotificationHandler, block_runs, check_layouts_match, invalid_block_ids, layout_from_dict,
    layout_to_dict,
)

logger = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
_MAX_FRAME = 64 << 20  # bytes; a header of a million block ids still fits
_IOV_MAX = 1024  # buffers per sendmsg/recvmsg_into call (Linux UIO_MAXIOV)


def _bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _move(sock: socket.socket, views: list[memoryview], deadline: float | None, send: bool) -> None:
    """Send all of ``views``, or fill them in order, by ``deadline`` (None: no limit)."""
    views, i = [v for v in views if len(v)], 0
    while i < len(views):
        sock.settimeout(None if deadline is None else _remaining(deadline))
        batch = views[i:i + _IOV_MAX]
        nbytes = sock.sendmsg(batch) if send else sock.recvmsg_into(batch)[0]
        if nbytes == 0:
            raise ConnectionError("connection closed by peer")
        while nbytes:  # skip the finished views, trim a partly done one
            done = min(nbytes, len(views[i]))
            views[i], nbytes = views[i][done:], nbytes - done
            if len(views[i]) == 0:
                i += 1


def _recv_into(sock: socket.socket, views: list[memoryview], deadline: float | None) -> None:
    _move(sock, views, deadline, send=False)


def _discard(sock: socket.socket, nbytes: int, deadline: float) -> None:
    """Read and drop ``nbytes``, keeping the stream in step after a refused write."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
    while nbytes:
        chunk = min(nbytes, len(scratch))
        _recv_into(sock, [scratch[:chunk]], deadline)
        nbytes -= chunk


def _send_frame(sock: socket.socket, obj: dict, deadline: float, extra: Sequence = ()) -> None:
    body = json.dumps(obj).encode()
    _move(sock, [memoryview(_LEN.pack(len(body))), memoryview(body), *extra], deadline, True)


def _recv_frame(sock: socket.socket, deadline: float | None, body_timeout_s: float = 0.0) -> dict:
    """Read one frame by ``deadline``; with None, wait forever for it to start, then allow
    ``body_timeout_s`` seconds for the rest. Raises OSError or ValueError on a bad frame."""
    head = bytearray(_LEN.size)
    _recv_into(sock, [memoryview(head)], deadline)
    (size,) = _LEN.unpack(head)
    if size > _MAX_FRAME:
        raise ConnectionError(f"frame of {size} bytes exceeds {_MAX_FRAME}")
    body = bytearray(size)
    _recv_into(sock, [memoryview(body)], deadline or time.monotonic() + body_timeout_s)
    obj = json.loads(body)
    if not isinstance(obj, dict):
        raise ConnectionError("frame is not a JSON object")
    return obj


class TcpKVTransport(KVTransport):
    """``KVTransport`` over plain TCP sockets (see the module doc for the wire and staging).

    The receiver listens on ``host:port`` (port 0: an ephemeral port, reported by
    ``metadata()``) and serves each connection on its own thread. ``advertise_host`` is the
    address peers dial (default: ``host``, or this machine's hostname when ``host`` is a
    wildcard). The sender keeps a pool of connections per peer, so concurrent writes to one
    peer run in parallel. ``connect_timeout_s`` bounds ``add_remote``'s connect and handshake;
    ``io_timeout_s`` bounds how long the receiver waits for the rest of a started frame.
    Raises ValueError when ``kv_cache`` disagrees with ``layout``.
    """

    def __init__(
        self, kv_cache: torch.Tensor, layout: KVCacheLayout, host: str = "127.0.0.1",
        port: int = 0, advertise_host: str | None = None, *,
        connect_timeout_s: float = 10.0, io_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(kv_cache, layout)
        self._staged = kv_cache.device.type != "cpu"  # through host buffers (module doc)
        # NOTE: a flat byte view of a CPU cache; slices of it are zero-copy regions.
        self._memory = None if self._staged else _bytes(kv_cache)
        self._bytes_per_block = layout.num_layers * 2 * layout.block_bytes  # all layers, K+V
        self.name = f"tcp-{uuid.uuid4().hex[:12]}"
        self._connect_timeout_s, self._io_timeout_s = connect_timeout_s, io_timeout_s
        self._handler: NotificationHandler | None = None
        self._handler_lock = threading.Lock()  # NOTE: held while the handler runs: one at a time
        self._lock = threading.Lock()  # guards the fields below
        self._closed = False
        self._peers: dict[str, tuple[str, int]] = {}  # name -> address
        self._idle: dict[str, list[socket.socket]] = {}  # name -> pooled sender connections
        self._sockets: set[socket.socket] = set()  # every open connection, both sides
        self._serve_threads: list[threading.Thread] = []
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family)
        self._listener.settimeout(1.0)  # NOTE: where shutdown() cannot wake accept, it polls
        wildcard = host in ("", "0.0.0.0", "::")
        self._address = (advertise_host or (socket.gethostname() if wildcard else host),
                         self._listener.getsockname()[1])
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kv-tcp-accept",
                                               daemon=True)
        self._accept_thread.start()

    # ---- both sides -------------------------------------------------------------------------

    def metadata(self) -> bytes:
        host, port = self._address
        return json.dumps({"backend": "tcp", "name": self.name, "host": host, "port": port,
                           "layout": layout_to_dict(self.layout),
                           "num_blocks": self.num_blocks}).encode()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            socks = [*self._sockets, self._listener]
            idle = [sock for pool in self._idle.values() for sock in pool]
            self._idle.clear()
        for sock in socks:  # wakes threads blocked in accept, recv or send; they close theirs
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for sock in idle:
            self._forget(sock)
        self._accept_thread.join()
        self._listener.close()
        deadline = time.monotonic() + 5.0  # a handler stuck in user code must not stall close
        for thread in self._serve_threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))

    def _send_regions(self, block_ids: Sequence[int]) -> list[memoryview]:
        """The payload of a write of ``block_ids``: cache views, or one staged host copy."""
        if not self._staged:
            return self._regions(block_ids)
        return [_bytes(gather_blocks(self.kv_cache, self._index(block_ids)).cpu())]

    def _recv_payload(self, sock: socket.socket, block_ids: Sequence[int],
                      deadline: float) -> None:
        """Fill ``block_ids`` from the socket: straight into the cache, or through a host buffer."""
        if not self._staged:
            _recv_into(sock, self._regions(block_ids), deadline)
            return
        shape = (self.layout.num_layers, 2, len(block_ids), *self.kv_cache.shape[3:])
        buffer = torch.empty(shape, dtype=self.kv_cache.dtype)
        _recv_into(sock, [_bytes(buffer)], deadline)
        scatter_blocks(buffer.to(self.kv_cache.device), self.kv_cache, self._index(block_ids))

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64, device=self.kv_cache.device)

    def _regions(self, block_ids: Sequence[int]) -> list[memoryview]:
        """Views of a CPU cache in payload order: layer, K then V, runs of ``block_ids``."""
        size, runs = self.layout.block_bytes, block_runs(block_ids)
        views = []
        for layer in range(self.layout.num_layers):
            for kv in (0, 1):
                base = (layer * 2 + kv) * self.num_blocks
                views += [self._memory[(base + first) * size:(base + first + n) * size]
                          for first, n in runs]
        return views

    def _forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        sock.close()

    # ---- sender side ------------------------------------------------------------------------

    def add_remote(self, metadata: bytes) -> str:
        try:
            meta = json.loads(metadata)
            name, address = meta["name"], (meta["host"], int(meta["port"]))
            backend, remote_layout = meta["backend"], layout_from_dict(meta["layout"])
        except (ValueError, KeyError, TypeError) as exc:
            raise KVTransferError(f"invalid TCP transport metadata: {exc!r}") from exc
        if backend != "tcp":
            raise KVTransferError(f"peer {name} uses backend {backend!r}, this one is 'tcp'")
        with self._lock:
            if self._closed:
                raise KVTransferError("transport is closed")
            if name in self._peers:
                return name
        check_layouts_match(self.layout, remote_layout, name)
        sock = self._connect(name, address, time.monotonic() + self._connect_timeout_s)
        with self._lock:
            self._peers.setdefault(name, address)
            self._idle.setdefault(name, [])
        self._release(name, sock)
        return name

    def _connect(self, name: str, address: tuple[str, int], deadline: float) -> socket.socket:
        """Open a connection to ``name`` and run the handshake; raises KVTransferError."""
        try:
            sock = socket.create_connection(address, timeout=_remaining(deadline))
        except OSError as exc:
            raise KVTransferError(f"cannot connect to peer {name} at {address}: {exc}") from exc
        with self._lock:
            if self._closed:
                sock.close()
                raise KVTransferError("transport is closed")
            self._sockets.add(sock)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _send_frame(sock, {"op": "hello", "layout": layout_to_dict(self.layout)}, deadline)
            reply = _recv_frame(sock, deadline)
            if not reply.get("ok"):
                if reply.get("fields"):
                    raise KVLayoutMismatchError(reply["error"], reply["fields"])
                raise KVTransferError(f"peer {name} refused the handshake: {reply.get('error')}")
            check_layouts_match(self.layout, layout_from_dict(reply["layout"]), name)
            if reply.get("name") != name:
                raise KVTransferError(f"{address} is agent {reply.get('name')}, not {name}")
            return sock
        except Exception as exc:
            self._forget(sock)
            if isinstance(exc, KVTransferError):
                raise
            raise KVTransferError(f"handshake with peer {name} failed: {exc!r}") from exc

    def _write(self, peer: str, local_ids: list[int], remote_ids: list[int],
               notification: bytes, timeout_s: float, deadline: float) -> None:
        sock = self._acquire(peer, deadline)
        header = {"op": "write", "remote_block_ids": remote_ids, "timeout_s": timeout_s,
                  "notif_len": len(notification),
                  "payload_bytes": len(local_ids) * self._bytes_per_block}
        try:
            _send_frame(sock, header, deadline, [memoryview(notification),
                                                 *self._send_regions(local_ids)])
            reply = _recv_frame(sock, deadline)
        except (OSError, ValueError) as exc:  # includes timeouts and a malformed reply
            self._forget(sock)
            if isinstance(exc, TimeoutError):
                raise KVTransferError(f"write to peer {peer} timed out after {timeout_s}s") from exc
            raise KVTransferError(f"write to peer {peer} failed: {exc!r}") from exc
        self._release(peer, sock)
        if not reply.get("ok"):
            raise KVTransferError(f"peer {peer} refused the write: {reply.get('error')}")

    def _acquire(self, peer: str, deadline: float) -> socket.socket:
        with self._lock:
            if self._closed:
                raise KVTransferError("transport is closed")
            if peer not in self._peers:
                raise KVTransferError(f"unknown peer {peer!r}; call add_remote first")
            if self._idle[peer]:
                return self._idle[peer].pop()
            address = self._peers[peer]
        return self._connect(peer, address, deadline)

    def _release(self, peer: str, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle[peer].append(sock)
                return
        self._forget(sock)

    # ---- receiver side ----------------------------------------------------------------------

    def set_notification_handler(self, handler: NotificationHandler) -> None:
        with self._handler_lock:
            self._handler = handler

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # the listener was shut down by close()
                return
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._sockets.add(sock)
                thread = threading.Thread(target=self._serve, args=(sock,), name="kv-tcp-serve",
                                          daemon=True)
                self._serve_threads = [t for t in self._serve_threads if t.is_alive()]
                self._serve_threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        """One connection: handshake, then writes until the peer hangs up or we close."""
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._handshake(sock):
                while not self._closed:
                    self._serve_write(sock, _recv_frame(sock, None, self._io_timeout_s))
        except (OSError, ValueError, KeyError, TypeError) as exc:  # peer gone, timeout, garbage
            if not self._closed:
                logger.info("kv transfer connection dropped: %r", exc)
        finally:
            self._forget(sock)

    def _handshake(self, sock: socket.socket) -> bool:
        deadline = time.monotonic() + self._io_timeout_s
        hello = _recv_frame(sock, deadline)
        try:
            check_layouts_match(self.layout, layout_from_dict(hello.get("layout")), "sender")
        except KVTransferError as exc:
            logger.warning("refused a KV transfer connection: %s", exc)
            fields = list(getattr(exc, "fields", ()))
            _send_frame(sock, {"ok": False, "error": str(exc), "fields": fields}, deadline)
            return False
        _send_frame(sock, {"ok": True, "name": self.name, "layout": layout_to_dict(self.layout),
                           "num_blocks": self.num_blocks}, deadline)
        return True

    def _serve_write(self, sock: socket.socket, header: dict) -> None:
        """Receive one write's notification and payload into the cache, notify, reply."""
        deadline = time.monotonic() + min(max(float(header["timeout_s"]), 0.1), 3600.0)
        ids, notif_len = header["remote_block_ids"], int(header["notif_len"])
        payload_bytes = int(header["payload_bytes"])
        if (header["op"] != "write" or not 0 <= notif_len <= MAX_NOTIFICATION_BYTES
                or payload_bytes < 0):
            raise ValueError(f"bad write header {header!r}")
        notification = bytearray(notif_len)
        _recv_into(sock, [memoryview(notification)], deadline)
        if problem := self._invalid_write(ids, payload_bytes):
            _discard(sock, payload_bytes, deadline)
            _send_frame(sock, {"ok": False, "error": problem}, deadline)
            return
        self._recv_payload(sock, ids, deadline)
        try:
            with self._handler_lock:
                if self._handler is None:
                    raise KVTransferError("receiver has no notification handler set")
                self._handler(bytes(notification))
        except Exception as exc:  # reported to the sender; the connection stays usable
            logger.exception("KV notification handler failed")
            _send_frame(sock, {"ok": False, "error": f"notification handler: {exc!r}"}, deadline)
            return
        _send_frame(sock, {"ok": True}, deadline)

    def _invalid_write(self, ids: object, payload_bytes: int) -> str | None:
        if not isinstance(ids, list):
            return "remote_block_ids must be a list"
        if problem := invalid_block_ids(ids, self.num_blocks):
            return f"remote {problem}"
        if payload_bytes != len(ids) * self._bytes_per_block:
            return f"payload of {payload_bytes} bytes does not match {len(ids)} blocks"
        return None
