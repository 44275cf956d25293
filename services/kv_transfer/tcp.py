"""Pure-Python TCP backend of ``KVTransport``: no extra dependencies.

Wire protocol (every frame: 4-byte big-endian length + UTF-8 JSON; framing in ``tcp_wire``):
- handshake: receiver ``{"op": "challenge", "nonce"}`` -> sender ``{"op": "hello", "layout",
  "nonce", "proof"}`` -> receiver ``{"ok", "name", "layout", "num_blocks", "proof"}`` or
  ``{"ok": false, "error", "fields"}``. Both sides compare layouts; with an internal secret
  each proves it (``proof``: HMAC over both nonces and the receiver's name), or is refused.
- write: sender ``{"op": "write", "remote_block_ids", "token", "notif_len", "layer_starts",
  "payload_bytes", "timeout_s"}``, then the notification bytes, then the payload in
  layer-major order (layer, K then V, the layer's blocks in list order: from its
  ``layer_starts`` entry on) -> receiver ``{"ok": true}`` or ``{"ok": false,
  "error"}``. A refused write (bad ids, no valid token) is read off the socket into scratch
  memory: not a byte reaches the cache. The receiver ``recvmsg_into``s an admitted payload
  straight into its cache's memory, never past the grant's lease; the sender ``sendmsg``s
  views of its cache; each side coalesces runs of consecutive block ids.
  NOTE: measured faster than gathering the blocks into one buffer first (no extra copy).
- direct write (both caches on one node's GPUs, or in one process: ``direct``): sender
  ``{"op": "write", "direct": true, ...}`` as above, then the notification and no payload ->
  receiver ``{"ok": true, "go": true}`` once it admitted the write (or a refusal) -> the
  sender copies its blocks into the receiver's cache on the device and waits for them ->
  ``{"op": "landed"}`` -> receiver ``{"ok": true}``. The receiver publishes its cache's CUDA IPC
  handle in ``metadata()``; a write whose ``landed`` does not come before the lease ends, or
  whose connection drops, is lost (``on_lost``), as a broken payload is.
- renew: sender ``{"op": "renew", "token"}`` -> receiver ``{"ok", "lease_s"}``.
- A cache on a GPU without a direct path to the peer (another node) is staged through host
  memory (``tcp_wire.payload_views``); same wire.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable

import torch

from kernels.kv_layout import KVCacheLayout
from services.kv_transfer.direct import copy_into, export_cache, open_peer_cache, unexport
from services.kv_transfer.errors import KVTransferError
from services.kv_transfer.layouts import check_layouts_match, layout_from_dict, layout_to_dict
from services.kv_transfer.transport import MAX_NOTIFICATION_BYTES, KVTransport
from services.kv_transfer.grants import handshake_proof
from services.kv_transfer.tcp_wire import (
    as_bytes, discard, payload_views, recv_frame, recv_into, recv_payload, remaining, send_frame,
)
from services.ports import listen

logger = logging.getLogger(__name__)


class TcpKVTransport(KVTransport):
    """``KVTransport`` over plain TCP sockets (see the module doc for the wire and staging).

    The receiver listens on ``host:port`` (port 0: a free port below the ephemeral range,
    ``services.ports``, reported by ``metadata()``) and serves each connection on its own
    thread. ``advertise_host`` is the address peers dial (default: ``host``, or this machine's hostname when ``host`` is a
    wildcard). The sender keeps a pool of connections per peer, so concurrent writes to one
    peer run in parallel. ``connect_timeout_s`` bounds ``add_remote``'s connect and handshake;
    ``io_timeout_s`` bounds how long the receiver waits for the rest of a started frame.
    ``direct_writes`` (default: when the cache is on a GPU): offer and use direct writes
    (``direct``: CUDA IPC between processes of one node, the tensor itself within one
    process), with the wire's payload as the fallback where a peer offers none.
    ``secret`` and ``require_grants``: see ``KVTransport``. Raises ValueError when
    ``kv_cache`` disagrees with ``layout``.
    """

    def __init__(
        self, kv_cache: torch.Tensor, layout: KVCacheLayout, host: str = "127.0.0.1",
        port: int = 0, advertise_host: str | None = None, *,
        connect_timeout_s: float = 10.0, io_timeout_s: float = 30.0,
        secret: str | None = None, require_grants: bool = False,
        direct_writes: bool | None = None,
    ) -> None:
        super().__init__(kv_cache, layout, secret=secret, require_grants=require_grants)
        self._staged = kv_cache.device.type != "cpu"  # through host buffers (module doc)
        # NOTE: a flat byte view of a CPU cache; slices of it are zero-copy regions.
        self._memory = None if self._staged else as_bytes(kv_cache)
        self.name = f"tcp-{uuid.uuid4().hex[:12]}"
        self._direct = kv_cache.is_cuda if direct_writes is None else direct_writes
        self._export = export_cache(self.name, kv_cache) if self._direct else None
        self._remote_caches: dict[str, torch.Tensor] = {}  # peer -> its cache, opened directly
        self._connect_timeout_s, self._io_timeout_s = connect_timeout_s, io_timeout_s
        self._lock = threading.Lock()  # guards the fields below
        self._closed = False
        self._peers: dict[str, tuple[str, int]] = {}  # name -> address
        self._idle: dict[str, list[socket.socket]] = {}  # name -> pooled sender connections
        self._sockets: set[socket.socket] = set()  # every open connection, both sides
        self._serve_threads: list[threading.Thread] = []
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = listen(lambda p: socket.create_server((host, p), family=family),
                                host, port)  # port 0: one below the ephemeral range
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
                           "num_blocks": self.num_blocks, "direct": self._export}).encode()

    def direct_peers(self) -> list[str]:
        """The peers this sender writes directly (``direct``), not over the wire."""
        with self._lock:
            return sorted(self._remote_caches)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            socks = [*self._sockets, self._listener]
            idle = [sock for pool in self._idle.values() for sock in pool]
            self._idle.clear()
            self._remote_caches.clear()  # unmaps the peers' caches opened by IPC
        unexport(self.name)
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

    def _cache_bytes(self) -> memoryview | None:  # None: staged through host buffers
        return None if self._staged else self._memory

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
        remote = self._open_direct(name, meta) if self._direct else None
        with self._lock:
            self._peers.setdefault(name, address)
            self._idle.setdefault(name, [])
            if remote is not None:
                self._remote_caches[name] = remote
        self._release(name, sock)
        return name

    def _open_direct(self, name: str, meta: dict) -> torch.Tensor | None:
        """The peer's cache opened for direct writes, if it offers them and its shape is the
        one its metadata states (else None: the wire)."""
        remote = open_peer_cache(name, meta.get("direct"), self.kv_cache)
        expected = (*self.kv_cache.shape[:2], meta.get("num_blocks"), *self.kv_cache.shape[3:])
        if remote is not None and (tuple(remote.shape) != expected
                                   or remote.dtype != self.kv_cache.dtype):
            logger.warning("peer %s's cache is %s %s, its metadata says %s: writing over the "
                           "wire", name, tuple(remote.shape), remote.dtype, expected)
            return None
        if remote is not None:
            logger.info("KV writes to peer %s go straight into its cache (%s)", name,
                        "same process" if meta["direct"]["pid"] == os.getpid() else "CUDA IPC")
        return remote

    def _connect(self, name: str, address: tuple[str, int], deadline: float) -> socket.socket:
        """Open a connection to ``name`` and run the handshake; raises KVTransferError."""
        try:
            sock = socket.create_connection(address, timeout=remaining(deadline))
        except OSError as exc:
            with self._lock:  # a peer gone for good must not keep its cache mapped here
                self._remote_caches.pop(name, None)
            raise KVTransferError(f"cannot connect to peer {name} at {address}: {exc}") from exc
        with self._lock:
            if self._closed:
                sock.close()
                raise KVTransferError("transport is closed")
            self._sockets.add(sock)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            theirs, ours = str(recv_frame(sock, deadline).get("nonce")), secrets.token_hex(16)
            send_frame(sock, {"op": "hello", "layout": layout_to_dict(self.layout), "nonce": ours,
                              "proof": handshake_proof(self.secret, "kv-hello", theirs, ours, name)},
                       deadline)
            reply = recv_frame(sock, deadline)
            self._check_welcome(name, reply, ours, theirs)
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
               notification: bytes, token: bytes, timeout_s: float, deadline: float,
               layer_starts: tuple[int, ...]) -> None:
        header = {"op": "write", "remote_block_ids": remote_ids, "timeout_s": timeout_s,
                  "token": token.hex(), "notif_len": len(notification),
                  "layer_starts": list(layer_starts),
                  "payload_bytes": self._payload_bytes(layer_starts, len(local_ids))}
        with self._lock:
            remote = self._remote_caches.get(peer)
        if remote is not None:
            header["direct"] = True
            reply = self._exchange(
                peer, header, [memoryview(notification)], deadline, "write",
                landed=lambda: copy_into(self.kv_cache, remote, local_ids, remote_ids,
                                         layer_starts))
        else:
            payload = payload_views(self.kv_cache, self._cache_bytes(), local_ids, layer_starts)
            reply = self._exchange(peer, header, [memoryview(notification), *payload],
                                   deadline, "write")
        if not reply.get("ok"):
            raise KVTransferError(f"peer {peer} refused the write: {reply.get('error')}")

    def _send_renewal(self, peer: str, token: bytes, deadline: float) -> dict:
        return self._exchange(peer, {"op": "renew", "token": token.hex()}, [], deadline, "renew")

    def _exchange(self, peer: str, header: dict, payload: list, deadline: float,
                  what: str, landed: Callable[[], None] | None = None) -> dict:
        """Send one request frame (+ ``payload``) on a pooled connection; the peer's answer.
        ``landed``: a direct write's copy, run when the peer says go, then reported."""
        sock = self._acquire(peer, deadline)
        try:
            send_frame(sock, header, deadline, payload)
            reply = recv_frame(sock, deadline)
            if landed is not None and reply.get("go"):
                landed()
                send_frame(sock, {"op": "landed"}, deadline)
                reply = recv_frame(sock, deadline)
        except Exception as exc:  # timeouts, a malformed reply, a failed device copy
            self._forget(sock)  # NOTE: mid-exchange: the peer sees the drop and drops the write
            if isinstance(exc, TimeoutError):
                raise KVTransferError(f"{what} to peer {peer} timed out") from exc
            raise KVTransferError(f"{what} to peer {peer} failed: {exc!r}") from exc
        self._release(peer, sock)
        return reply

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
            peer = "%s:%s" % sock.getpeername()[:2]
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._handshake(sock, peer):
                while not self._closed:
                    self._serve_request(sock, recv_frame(sock, None, self._io_timeout_s), peer)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # peer gone, timeout, garbage
            if not self._closed:
                logger.info("kv transfer connection dropped: %r", exc)
        finally:
            self._forget(sock)

    def _handshake(self, sock: socket.socket, peer: str) -> bool:
        deadline = time.monotonic() + self._io_timeout_s
        ours = secrets.token_hex(16)
        send_frame(sock, {"op": "challenge", "nonce": ours}, deadline)
        hello = recv_frame(sock, deadline)
        theirs = str(hello.get("nonce"))
        if refusal := self.receiver.check_hello(peer, hello.get("layout"), hello.get("proof"), ours,
                                        theirs, self.name):
            send_frame(sock, refusal, deadline)
            return False
        send_frame(sock, {"ok": True, "name": self.name, "layout": layout_to_dict(self.layout),
                          "num_blocks": self.num_blocks,
                          "proof": handshake_proof(self.secret, "kv-ack", theirs, ours)}, deadline)
        return True

    def _serve_request(self, sock: socket.socket, header: dict, peer: str) -> None:
        """Serve one request frame: a write (admitted or refused untouched) or a renewal."""
        deadline = time.monotonic() + min(max(float(header.get("timeout_s", 5.0)), 0.1), 3600.0)
        token = bytes.fromhex(str(header.get("token", "")))
        if header["op"] == "renew":
            send_frame(sock, self.receiver.renew(peer, token), deadline)
            return
        ids, notif_len = header["remote_block_ids"], int(header["notif_len"])
        payload_bytes = int(header["payload_bytes"])
        if (header["op"] != "write" or not 0 <= notif_len <= MAX_NOTIFICATION_BYTES
                or payload_bytes < 0):
            raise ValueError(f"bad write header {header!r}")
        notification = bytearray(notif_len)
        recv_into(sock, [memoryview(notification)], deadline)
        grant, problem = None, ""
        starts, expected, problem = self._incoming_layers(ids, header.get("layer_starts"))
        if not problem and payload_bytes != expected:
            problem = f"payload of {payload_bytes} bytes does not match its blocks ({expected})"
        direct = header.get("direct") is True
        if not problem and direct and not self._direct:
            problem = "this receiver does not offer direct writes"
        if not problem:
            grant, problem = self.receiver.admit_write(peer, token, ids)
        if problem:
            if not direct:
                discard(sock, payload_bytes, deadline)
            send_frame(sock, {"ok": False, "error": problem}, deadline)
            return
        until = deadline if grant is None else min(deadline, grant.expires_at)
        try:  # NOTE: an admitted write lands before its lease ends, or not at all
            if direct:
                send_frame(sock, {"ok": True, "go": True}, until)
                if recv_frame(sock, until).get("op") != "landed":
                    raise ValueError("a direct write's sender did not report it landed")
            else:
                recv_payload(sock, self.kv_cache, self._cache_bytes(), ids, starts, until)
        except BaseException as exc:
            self.receiver.write_lost(grant, f"the KV write broke off at the receiver ({exc!r})")
            raise
        self.receiver.received(payload_bytes)
        send_frame(sock, self.receiver.deliver(grant, bytes(notification)), deadline)
