"""NIXL backend of ``KVTransport``: one-sided WRITEs over UCX (shared memory or TCP on CPU,
NVLink/RDMA on GPUs), the library vLLM's NixlConnector, SGLang and Dynamo use.

Registration: each layer's K and V region once. Descriptor lists, prepared once (ours at start,
a peer's at ``add_remote``): one entry per (layer, K/V, block) at index
``(layer * 2 + kv) * num_blocks + block``; NIXL merges runs contiguous on both sides.
Everything but the data rides on NIXL notifications (no extra service); a message is a kind
byte + an 8-byte tag (matches an answer to its waiting call) + a body:
- ``metadata()``: JSON (``nixl_agent.register_cache``) with the base64 NIXL agent metadata.
- handshake: the sender loads the receiver's agent metadata, checks layouts and sends ``H`` +
  JSON ``{"layout", "agent_md", "proof"}``; the receiver loads the sender's agent metadata,
  checks layout and proof (HMAC of the internal secret over both agent names) and answers
  ``A`` + JSON ``{"ok", "error", "fields", "proof"}``.
- write: one prepped WRITE of all the blocks' descriptors carrying ``W`` + ``encode_write``
  (token, remote block ids, layer starts, the user's bytes), delivered after the data landed;
  the receiver admits it (``KVTransport._admit_write``), runs the handler, answers ``A``. NOTE: one-sided
  WRITEs land before the receiver sees anything: it can refuse to act on a forged write, not
  keep its bytes out (docs/architecture.md: network isolation does that).
- renew: ``R`` + the token -> ``A`` + JSON ``{"ok", "lease_s"}``.
- ``close()`` sends ``B`` (bye) to every known agent: their waits on us fail at once."""
from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Sequence

import torch

from kernels.kv_layout import KVCacheLayout
from services.kv_transfer.block_ids import invalid_block_ids, layer_block_count
from services.kv_transfer.errors import KVTransferError
from services.kv_transfer.layouts import check_layouts_match
from services.kv_transfer.transport import KVTransport
from services.kv_transfer.grants import handshake_proof
from services.kv_transfer.nixl_agent import (
    NIXL_MISSING, Peer, Waiter, agent_metadata, call_agent, decode_write, descriptor_indices,
    descriptor_rows, encode_write, load_nixl, parse_metadata, register_cache, release_xfer,
    start_agent,
)

__all__ = ["NIXL_MISSING", "NixlKVTransport", "load_nixl"]

logger = logging.getLogger(__name__)

_HELLO, _WRITE, _ACK, _BYE, _RENEW = b"H", b"W", b"A", b"B", b"R"
_TAG_BYTES = 8
_BUSY_POLL_S, _IDLE_POLL_S = 20e-6, 200e-6  # notification polling: busy / idle
_BUSY_WINDOW_S = 0.05  # busy: calls waiting, or a notification within this window
_XFER_POLL_S = 1e-3  # how often a waiting write checks its WRITE for an error


class NixlKVTransport(KVTransport):
    """``KVTransport`` over NIXL (module doc: the messages). ``kv_cache`` may be in CPU memory
    ("DRAM") or on a CUDA device ("VRAM"). ``backends`` are NIXL plugins (UCX reads ``UCX_TLS``
    / ``UCX_NET_DEVICES``); ``connect_timeout_s`` bounds ``add_remote``'s handshake. A poller
    thread drives NIXL (draining notifications makes UCX progress); a handler thread runs the
    notification handlers. ``secret``, ``require_grants``: see ``KVTransport``. Raises
    ValueError when ``kv_cache`` disagrees with ``layout``, ImportError without NIXL,
    KVTransferError when the agent cannot start (e.g. no usable UCX transport).
    """

    def __init__(self, kv_cache: torch.Tensor, layout: KVCacheLayout, *,
                 backends: Sequence[str] = ("UCX",), connect_timeout_s: float = 10.0,
                 secret: str | None = None, require_grants: bool = False) -> None:
        nixl = load_nixl()
        super().__init__(kv_cache, layout, secret=secret, require_grants=require_grants)
        self.name = f"nixl-{uuid.uuid4().hex[:12]}"
        self._connect_timeout_s = connect_timeout_s
        self._agent = start_agent(nixl, self.name, list(backends))
        self._registered, self._local_dlist, self._hello, self._metadata = register_cache(
            self._agent, kv_cache, layout, self.name)
        self._lock = threading.Lock()  # guards the fields below
        self._closed = False
        self._tags = itertools.count()
        self._waiters: dict[tuple[str, bytes], Waiter] = {}  # (peer, tag) -> waiting call
        self._peers: dict[str, Peer] = {}
        self._gone: set[str] = set()  # agents that said bye
        self._loaded: set[str] = set()  # agents whose metadata our agent holds
        self._senders: set[str] = set()  # agents whose handshake we accepted
        self._inbox: queue.Queue[tuple[str, bytes, object, bytes] | None] = queue.Queue()
        self._poller = threading.Thread(target=self._poll_loop, name="kv-nixl-poll", daemon=True)
        self._runner = threading.Thread(target=self._handler_loop, name="kv-nixl-handler",
                                        daemon=True)
        self._poller.start()
        self._runner.start()

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
        return call_agent(self._agent, what, method, *args, quiet=quiet)

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError("transport is closed")

    # ---- sender side ------------------------------------------------------------------------

    def add_remote(self, metadata: bytes) -> str:
        meta = parse_metadata(metadata)
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
        hello = {**self._hello, "proof": handshake_proof(self.secret, "kv-hello", self.name, name)}
        reply = self._request(name, _HELLO + json.dumps(hello).encode(), deadline, "handshake")
        self._check_welcome(name, reply, name, self.name)
        rows = descriptor_rows(meta["base_addr"], 2 * self.layout.num_layers * meta["num_blocks"],
                               self.layout.block_bytes, meta["device_id"])
        dlist = self._call(f"preparing the blocks of {name}", "prep_xfer_dlist", name, rows,
                           meta["mem_type"])
        with self._lock:  # NOTE: a concurrent add_remote of the same peer may have won
            self._peers.setdefault(name, Peer(meta["num_blocks"], dlist))
        return name

    def _write(self, peer: str, local_ids: list[int], remote_ids: list[int],
               notification: bytes, token: bytes, timeout_s: float, deadline: float,
               layer_starts: tuple[int, ...]) -> None:
        self._check_open()
        with self._lock:
            target = self._peers.get(peer)
            if peer in self._gone:
                raise KVTransferError(f"peer {peer} closed its transport")
        if target is None:
            raise KVTransferError(f"unknown peer {peer!r}; call add_remote first")
        if problem := invalid_block_ids(remote_ids, target.num_blocks):
            raise KVTransferError(f"peer {peer} refuses the write: remote {problem}")
        blocks = (self._local_dlist, descriptor_indices(self.num_blocks, local_ids, layer_starts),
                  target.dlist, descriptor_indices(target.num_blocks, remote_ids, layer_starts))
        copies = layer_block_count(layer_starts, len(local_ids))
        message = _WRITE + encode_write(token, remote_ids, layer_starts, notification)
        reply = self._request(peer, message, deadline, "write", blocks if copies else None)
        if not reply.get("ok"):
            raise KVTransferError(f"peer {peer} refused the write: {reply.get('error')}")

    def _send_renewal(self, peer: str, token: bytes, deadline: float) -> dict:
        self._check_open()
        return self._request(peer, _RENEW + token, deadline, "renew")

    def _request(self, peer: str, message: bytes, deadline: float, what: str,
                 blocks: tuple | None = None) -> dict:
        """Send ``message`` (kind byte + body) to ``peer`` with a fresh tag, as a standalone
        notification or carried by a WRITE of ``blocks`` (local dlist, local indices, remote
        dlist, remote indices), and return the peer's answer. Raises KVTransferError."""
        waiter, xfer = Waiter(), None
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
            if xfer is not None:
                release_xfer(self._agent, xfer, deadline, _BUSY_POLL_S)
        if waiter.error:
            raise KVTransferError(f"{what} to peer {peer} failed: {waiter.error}")
        return waiter.reply or {}

    # ---- receiver side ----------------------------------------------------------------------

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
        elif kind in (_WRITE, _RENEW) and sender not in self._senders:
            logger.warning("refused a KV message from NIXL agent %s: no accepted handshake", sender)
            self._answer(sender, tag, {"ok": False, "error": "no accepted handshake"})
        elif kind == _WRITE:
            self._admit(sender, tag, body)
        elif kind == _RENEW:
            self._answer(sender, tag, self.receiver.renew(sender, body))
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
                       agent_metadata(hello))
            with self._lock:
                self._loaded.add(sender)
        if refusal := self.receiver.check_hello(sender, hello.get("layout"), hello.get("proof"), sender,
                                        self.name):
            self._answer(sender, tag, refusal)
            return
        self._senders.add(sender)
        self._answer(sender, tag, {"ok": True,
                                   "proof": handshake_proof(self.secret, "kv-ack", self.name, sender)})

    def _admit(self, sender: str, tag: bytes, body: bytes) -> None:
        """A write's notification: its blocks have landed; queue it for the handler if its
        token admits them, else answer the refusal (the blocks are not acted on)."""
        token, remote_ids, layer_starts, notification = decode_write(body)
        _, nbytes, problem = self._incoming_layers(remote_ids, layer_starts)
        grant = None
        if not problem:
            grant, problem = self.receiver.admit_write(sender, token, remote_ids)
        if problem:
            self._answer(sender, tag, {"ok": False, "error": problem})
        else:
            self.receiver.received(nbytes)
            self._inbox.put((sender, tag, grant, notification))

    def _peer_gone(self, name: str) -> None:
        """``name`` closed: fail our waits on it, forget it as sender and as peer. NOTE: its
        agent metadata stays loaded (a few KB): a write may still use descriptors into it."""
        with self._lock:
            self._gone.add(name)
            self._senders.discard(name)
            self._loaded.discard(name)
            self._peers.pop(name, None)
            waiters = [w for (peer, _), w in self._waiters.items() if peer == name]
        for waiter in waiters:
            waiter.error = f"peer {name} closed its transport"
            waiter.done.set()

    def _handler_loop(self) -> None:  # the handler of each admitted write, one at a time
        while (item := self._inbox.get()) is not None:
            sender, tag, grant, notification = item
            self._answer(sender, tag, self.receiver.deliver(grant, notification))

    def _answer(self, peer: str, tag: bytes, reply: dict) -> None:
        self._call(f"answering {peer}", "send_notif", peer,
                   _ACK + tag + json.dumps(reply).encode(), quiet=True)
