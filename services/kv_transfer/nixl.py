"""NIXL backend of ``KVTransport``: one-sided WRITEs over UCX (shared memory or TCP on CPU,
NVLink/RDMA on GPUs), the library vLLM's NixlConnector, SGLang and Dynamo use.

Registration: each layer's K and V region once. Descriptor lists, prepared once (ours at start,
a peer's at ``add_remote``): one entry per (layer, K/V, block) at index
``(layer * 2 + kv) * num_blocks + block``; NIXL merges runs contiguous on both sides.
Everything but the data rides on NIXL notifications (no extra service); a message is a kind
byte + an 8-byte tag (matches an answer to its waiting call) + a body:
- ``metadata()``: JSON ``{"backend", "name", "layout", "num_blocks", "base_addr",
  "device_id", "mem_type", "agent_md"}`` (base64 NIXL agent metadata: address + registrations).
- handshake: the sender loads the receiver's agent metadata, checks layouts and sends ``H`` +
  JSON ``{"layout", "agent_md"}``; the receiver loads the sender's agent metadata (to answer
  it), checks the layout and answers ``A`` + JSON ``{"ok", "error", "fields"}``.
- write: one prepped WRITE of all the blocks' descriptors carrying ``W`` + the user's bytes,
  delivered by NIXL after the data landed; the receiver runs the handler, then answers ``A``.
- ``close()`` sends ``B`` (bye) to every known agent, which fails their waits on us at once.
"""
from __future__ import annotations

import base64
import importlib
import itertools
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch

from kernels.kv_layout import KVCacheLayout
from services.kv_transfer.base import (
    KVLayoutMismatchError, KVTransferError, KVTransport, NotificationHandler,
    check_layouts_match, invalid_block_ids, layout_from_dict, layout_to_dict,
)

logger = logging.getLogger(__name__)

NIXL_MISSING = "NIXL is not installed (pip install nixl-cu12); use --kv-transport tcp"
_MODULES = ("nixl_cu12", "nixl._api")  # the wheel we depend on, then the `nixl` meta package
_HELLO, _WRITE, _ACK, _BYE = b"H", b"W", b"A", b"B"
_TAG_BYTES = 8
_BUSY_POLL_S, _IDLE_POLL_S = 20e-6, 200e-6  # notification polling: busy / idle
_BUSY_WINDOW_S = 0.05  # busy: calls waiting, or a notification within this window
_XFER_POLL_S = 1e-3  # how often a waiting write checks its WRITE for an error


def load_nixl() -> ModuleType:
    """NIXL's Python API module. Raises ImportError naming the TCP fallback when absent."""
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except (ImportError, OSError):  # OSError: one of its shared libraries failed to load
            continue
    raise ImportError(NIXL_MISSING)


def _rows(base: int, count: int, size: int, device_id: int) -> np.ndarray:
    """``[count, 3]`` NIXL descriptors (address, bytes, device id) of back-to-back regions."""
    rows = np.empty((count, 3), dtype=np.uint64)
    rows[:, 0] = np.uint64(base) + np.arange(count, dtype=np.uint64) * np.uint64(size)
    rows[:, 1], rows[:, 2] = size, device_id
    return rows


def _parse_metadata(metadata: bytes) -> dict:
    """A peer's ``metadata()`` as typed fields; raises KVTransferError when invalid."""
    try:
        meta = json.loads(metadata)
        if meta["backend"] != "nixl":
            raise KVTransferError(f"peer {meta.get('name')} uses backend {meta['backend']!r}, "
                                  "this one is 'nixl'")
        return {"name": str(meta["name"]), "layout": layout_from_dict(meta["layout"]),
                "num_blocks": int(meta["num_blocks"]), "base_addr": int(meta["base_addr"]),
                "device_id": int(meta["device_id"]), "mem_type": str(meta["mem_type"]),
                "agent_md": base64.b64decode(meta["agent_md"], validate=True)}
    except (ValueError, KeyError, TypeError) as exc:
        raise KVTransferError(f"invalid NIXL transport metadata: {exc!r}") from exc


@dataclass
class _Peer:
    """A receiver this transport writes to."""

    num_blocks: int
    dlist: object  # its prepped descriptor list, one entry per (layer, K/V, block)


@dataclass
class _Waiter:
    """A handshake or write waiting for the peer's answer."""

    done: threading.Event = field(default_factory=threading.Event)
    reply: dict | None = None  # the peer's answer
    error: str | None = None  # why it failed on our side: closed, peer gone


class NixlKVTransport(KVTransport):
    """``KVTransport`` over NIXL (see the module doc for the messages).

    ``kv_cache`` may be in CPU memory ("DRAM") or on a CUDA device ("VRAM"). ``backends`` are
    NIXL plugins (UCX reads ``UCX_TLS`` / ``UCX_NET_DEVICES``); ``connect_timeout_s`` bounds
    ``add_remote``'s handshake. A poller thread drives NIXL: it drains notifications (and so
    UCX progress); a handler thread runs the notification handler. Raises ValueError when
    ``kv_cache`` disagrees with ``layout``, ImportError without NIXL, KVTransferError when
    the agent cannot start (e.g. no usable UCX transport).
    """

    def __init__(self, kv_cache: torch.Tensor, layout: KVCacheLayout, *,
                 backends: Sequence[str] = ("UCX",), connect_timeout_s: float = 10.0) -> None:
        nixl = load_nixl()
        super().__init__(kv_cache, layout)
        self.name = f"nixl-{uuid.uuid4().hex[:12]}"
        self._connect_timeout_s = connect_timeout_s
        self._agent = _start_agent(nixl, self.name, list(backends))
        try:
            self._metadata = self._register()
        except Exception as exc:  # NIXL's own error types
            raise KVTransferError(f"NIXL could not register the KV cache: {exc!r}") from exc
        self._lock = threading.Lock()  # guards the fields below
        self._closed = False
        self._tags = itertools.count()
        self._waiters: dict[tuple[str, bytes], _Waiter] = {}  # (peer, tag) -> waiting call
        self._peers: dict[str, _Peer] = {}
        self._gone: set[str] = set()  # agents that said bye
        self._loaded: set[str] = set()  # agents whose metadata our agent holds
        self._senders: set[str] = set()  # agents whose handshake we accepted
        self._handler: NotificationHandler | None = None
        self._handler_lock = threading.Lock()  # NOTE: held while the handler runs: one at a time
        self._inbox: queue.Queue[tuple[str, bytes, bytes] | None] = queue.Queue()
        self._poller = threading.Thread(target=self._poll_loop, name="kv-nixl-poll", daemon=True)
        self._runner = threading.Thread(target=self._handler_loop, name="kv-nixl-handler",
                                        daemon=True)
        self._poller.start()
        self._runner.start()

    def _register(self) -> bytes:
        """Register each layer's K and V, prepare our block descriptors; return metadata()."""
        on_gpu = self.kv_cache.device.type == "cuda"
        mem_type, device_id = ("VRAM" if on_gpu else "DRAM"), self.kv_cache.device.index or 0
        regions, base = 2 * self.layout.num_layers, self.kv_cache.data_ptr()
        size = self.layout.block_bytes
        self._registered = self._agent.register_memory(
            _rows(base, regions, self.num_blocks * size, device_id), mem_type)
        self._local_dlist = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _rows(base, regions * self.num_blocks, size, device_id), mem_type)
        agent_md = base64.b64encode(self._agent.get_agent_metadata()).decode()
        layout = layout_to_dict(self.layout)
        self._hello = json.dumps({"layout": layout, "agent_md": agent_md}).encode()
        return json.dumps({"backend": "nixl", "name": self.name, "layout": layout,
                           "num_blocks": self.num_blocks, "base_addr": base,
                           "device_id": device_id, "mem_type": mem_type,
                           "agent_md": agent_md}).encode()

    # ---- both sides -------------------------------------------------------------------------

    def metadata(self) -> bytes:
        return self._metadata

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            waiters, self._waiters = list(self._waiters.values()), {}
            loaded = list(self._loaded)
        for waiter in waiters:
            waiter.error = "transport is closed"
            waiter.done.set()
        for name in loaded:  # peers fail their waits on us now, not at their timeout
            self._call("saying bye", "send_notif", name, _BYE, quiet=True)
        self._poller.join()
        self._inbox.put(None)
        self._runner.join(timeout=5.0)  # a handler stuck in user code must not stall close
        with self._lock:
            self._peers.clear()
        # NOTE: NIXL frees descriptor lists, registrations and the agent when the last
        # reference goes: ours now, or an in-flight call's when it returns (never under it).
        self._local_dlist = self._registered = self._agent = None

    def _call(self, what: str, method: str, *args, quiet: bool = False):
        """``self._agent.<method>(*args)``; raises KVTransferError (or logs, when ``quiet``)."""
        try:
            return getattr(self._agent, method)(*args)
        except Exception as exc:  # NIXL raises its own error types; the agent is None if closed
            if not quiet:
                raise KVTransferError(f"NIXL {what} failed: {exc!r}") from exc
            logger.debug("NIXL %s failed: %r", what, exc)
            return None

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError("transport is closed")

    # ---- sender side ------------------------------------------------------------------------

    def add_remote(self, metadata: bytes) -> str:
        meta = _parse_metadata(metadata)
        name = meta["name"]
        self._check_open()
        if name in self._peers:
            return name
        check_layouts_match(self.layout, meta["layout"], name)
        loaded = self._call(f"loading the metadata of {name}", "add_remote_agent",
                            meta["agent_md"])
        if (loaded.decode() if isinstance(loaded, bytes) else loaded) != name:
            raise KVTransferError(f"metadata of {name} describes agent {loaded!r}")
        with self._lock:
            self._loaded.add(name)
        deadline = time.monotonic() + self._connect_timeout_s
        reply = self._request(name, _HELLO + self._hello, deadline, "handshake")
        if reply.get("fields"):
            raise KVLayoutMismatchError(str(reply.get("error")), reply["fields"])
        if not reply.get("ok"):
            raise KVTransferError(f"peer {name} refused the handshake: {reply.get('error')}")
        rows = _rows(meta["base_addr"], 2 * self.layout.num_layers * meta["num_blocks"],
                     self.layout.block_bytes, meta["device_id"])
        dlist = self._call(f"preparing the blocks of {name}", "prep_xfer_dlist", name, rows,
                           meta["mem_type"])
        with self._lock:  # NOTE: a concurrent add_remote of the same peer may have won
            self._peers.setdefault(name, _Peer(meta["num_blocks"], dlist))
        return name

    def _write(self, peer: str, local_ids: list[int], remote_ids: list[int],
               notification: bytes, timeout_s: float, deadline: float) -> None:
        self._check_open()
        with self._lock:
            target = self._peers.get(peer)
            if peer in self._gone:
                raise KVTransferError(f"peer {peer} closed its transport")
        if target is None:
            raise KVTransferError(f"unknown peer {peer!r}; call add_remote first")
        if problem := invalid_block_ids(remote_ids, target.num_blocks):
            raise KVTransferError(f"peer {peer} refuses the write: remote {problem}")
        regions = np.arange(2 * self.layout.num_layers, dtype=np.int64)[:, None]
        local = (regions * self.num_blocks + local_ids).astype(np.int32).ravel()
        remote = (regions * target.num_blocks + remote_ids).astype(np.int32).ravel()
        blocks = (self._local_dlist, local, target.dlist, remote) if local_ids else None
        reply = self._request(peer, _WRITE + bytes(notification), deadline, "write", blocks)
        if not reply.get("ok"):
            raise KVTransferError(f"peer {peer} refused the write: {reply.get('error')}")

    def _request(self, peer: str, message: bytes, deadline: float, what: str,
                 blocks: tuple | None = None) -> dict:
        """Send ``message`` (kind byte + body) to ``peer`` with a fresh tag, as a standalone
        notification or carried by a WRITE of ``blocks`` (local dlist, local indices, remote
        dlist, remote indices), and return the peer's answer. Raises KVTransferError."""
        waiter, xfer = _Waiter(), None
        with self._lock:
            if self._closed or peer in self._gone:
                raise KVTransferError(f"{what} to peer {peer}: closed")
            tag = next(self._tags).to_bytes(_TAG_BYTES, "big")
            self._waiters[peer, tag] = waiter
        message = message[:1] + tag + message[1:]
        try:
            if blocks is None:
                self._call(f"{what} notification to {peer}", "send_notif", peer, message)
            else:
                xfer = self._call("preparing a WRITE", "make_prepped_xfer", "WRITE", *blocks,
                                  message)
                if self._call("posting a WRITE", "transfer", xfer) == "ERR":
                    raise KVTransferError(f"NIXL could not post the WRITE to peer {peer}")
            while not waiter.done.wait(min(_XFER_POLL_S, max(deadline - time.monotonic(), 0))):
                if time.monotonic() >= deadline:
                    raise KVTransferError(f"{what} to peer {peer} timed out")
                if xfer is not None and self._call("checking a WRITE", "check_xfer_state",
                                                   xfer) == "ERR":
                    raise KVTransferError(f"NIXL WRITE to peer {peer} failed")
        finally:
            with self._lock:
                self._waiters.pop((peer, tag), None)
            if xfer is not None:  # NOTE: once NIXL is done with it, or at the deadline
                while (time.monotonic() < deadline and self._call(
                        "checking a WRITE", "check_xfer_state", xfer, quiet=True) == "PROC"):
                    time.sleep(_BUSY_POLL_S)
                self._call("releasing a WRITE", "release_xfer_handle", xfer, quiet=True)
        if waiter.error:
            raise KVTransferError(f"{what} to peer {peer} failed: {waiter.error}")
        return waiter.reply or {}

    # ---- receiver side ----------------------------------------------------------------------

    def set_notification_handler(self, handler: NotificationHandler) -> None:
        with self._handler_lock:
            self._handler = handler

    def _poll_loop(self) -> None:
        """Drain notifications: answers, handshakes and byes here, writes to the handler.

        NOTE: these calls also make UCX progress, which a WRITE's completion waits on (on
        both sides), so polling is fast while busy and slower when idle, to spare the CPU.
        """
        busy_until = 0.0
        while not self._closed:
            notifs = self._call("polling notifications", "get_new_notifs", quiet=True) or {}
            now = time.monotonic()
            if notifs or self._waiters:
                busy_until = now + _BUSY_WINDOW_S
            for sender, messages in notifs.items():
                sender = sender.decode() if isinstance(sender, bytes) else sender
                for message in messages:
                    try:
                        self._dispatch(sender, bytes(message))
                    except Exception:  # a bad message must not stop the poller
                        logger.exception("bad NIXL notification from %s", sender)
            time.sleep(_BUSY_POLL_S if now < busy_until else _IDLE_POLL_S)

    def _dispatch(self, sender: str, message: bytes) -> None:
        kind, tag, body = message[:1], message[1:1 + _TAG_BYTES], message[1 + _TAG_BYTES:]
        if kind == _ACK:
            with self._lock:
                waiter = self._waiters.pop((sender, tag), None)
            if waiter is not None:
                waiter.reply = json.loads(body)
                waiter.done.set()
        elif kind == _WRITE and sender in self._senders:
            self._inbox.put((sender, tag, body))
        elif kind == _WRITE:
            self._answer(sender, tag, {"ok": False, "error": "no accepted handshake"})
        elif kind == _HELLO:
            self._accept(sender, tag, json.loads(body))
        elif kind == _BYE:
            self._peer_gone(sender)
        else:
            logger.warning("unknown NIXL notification kind %r from %s", kind, sender)

    def _accept(self, sender: str, tag: bytes, hello: dict) -> None:
        """Load a sender's agent metadata (to answer it), check its layout, answer."""
        if sender not in self._loaded:  # NOTE: keep what add_remote loaded: same agent
            self._call(f"loading the metadata of {sender}", "add_remote_agent",
                       base64.b64decode(hello["agent_md"]))
            with self._lock:
                self._loaded.add(sender)
        try:
            check_layouts_match(self.layout, layout_from_dict(hello.get("layout")), sender)
        except KVTransferError as exc:
            logger.warning("refused a KV transfer handshake: %s", exc)
            fields = list(getattr(exc, "fields", ()))
            self._answer(sender, tag, {"ok": False, "error": str(exc), "fields": fields})
            return
        self._senders.add(sender)
        self._answer(sender, tag, {"ok": True})

    def _peer_gone(self, name: str) -> None:
        """``name`` closed: fail our waits on it, forget it as sender and as peer.

        NOTE: its agent metadata stays loaded (a few KB): removing it while a write may still
        use descriptors that point into it is unsafe; its descriptors go with the last user.
        """
        with self._lock:
            self._gone.add(name)
            self._senders.discard(name)
            self._loaded.discard(name)
            self._peers.pop(name, None)
            waiters = [w for (peer, _), w in self._waiters.items() if peer == name]
        for waiter in waiters:
            waiter.error = f"peer {name} closed its transport"
            waiter.done.set()

    def _handler_loop(self) -> None:
        """Run the handler once per landed write, one at a time, and answer the sender."""
        while (item := self._inbox.get()) is not None:
            sender, tag, notification = item
            try:
                with self._handler_lock:
                    if self._handler is None:
                        raise KVTransferError("receiver has no notification handler set")
                    self._handler(notification)
                reply = {"ok": True}
            except Exception as exc:  # reported to the sender
                logger.warning("KV notification handler failed: %r", exc)
                reply = {"ok": False, "error": f"notification handler: {exc!r}"}
            self._answer(sender, tag, reply)

    def _answer(self, peer: str, tag: bytes, reply: dict) -> None:
        self._call(f"answering {peer}", "send_notif", peer,
                   _ACK + tag + json.dumps(reply).encode(), quiet=True)


def _start_agent(nixl: ModuleType, name: str, backends: list[str]):
    """A NIXL agent safe to call from many threads; raises KVTransferError when it fails.

    NOTE: no NIXL progress thread: the Python API starts it busy-polling (about 65% of a core
    per agent, measured); our poller's ``get_new_notifs`` calls make UCX progress instead.
    """
    config = nixl.nixl_agent_config(
        backends=backends, enable_prog_thread=False,
        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    try:
        agent = nixl.nixl_agent(name, config)
    except Exception as exc:
        raise KVTransferError(f"cannot start a NIXL agent with backends {backends}: {exc!r} "
                              "(check UCX_TLS / UCX_NET_DEVICES)") from exc
    if not agent.backends:
        raise KVTransferError(f"none of the NIXL backends {backends} is available")
    return agent
