"""The one interface every KV-cache transfer backend implements (TCP and NIXL).

A prefill worker (sender) computes a prompt's KV cache into its own paged cache, then writes
those blocks into blocks a decode worker (receiver) reserved, with a notification; the decode
worker learns of completion only from that notification and then admits the sequence.

The shape follows NIXL's agent model so a NIXL backend fits without changing callers:
register the whole cache once (``__init__``), publish opaque agent metadata (``metadata``),
load a peer's metadata (``add_remote``), then one WRITE with a notification per handoff
(``write_blocks``); the receiver is told by its notification handler, never by polling memory.

The receiver side every backend shares lives here: the handshake's layout and secret checks, the
admission of a write (block ids in range; with ``require_grants``, a granted single-use token,
see ``grants.py``), lease renewals, and running the handler under one lock.
"""
from __future__ import annotations

import logging
import operator
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from kernels.kv_layout import KVCacheLayout
from services.kv_transfer.common import (  # re-exported: what the backends import
    MAX_NOTIFICATION_BYTES, KVLayoutMismatchError, KVLeaseRefusedError, KVTransferError, block_runs,
    check_layouts_match, invalid_block_ids, layout_from_dict, layout_to_dict,
)
from services.kv_transfer.grants import WriteGrant, WriteGrants, proof_ok

logger = logging.getLogger(__name__)

NotificationHandler = Callable[[bytes], None]

__all__ = [
    "MAX_NOTIFICATION_BYTES", "KVLayoutMismatchError", "KVLeaseRefusedError", "KVTransferError",
    "KVTransport",
    "NotificationHandler", "block_runs", "check_layouts_match", "invalid_block_ids",
    "layout_from_dict", "layout_to_dict",
]


class KVTransport(ABC):
    """Moves whole KV blocks from this worker's cache into a peer's cache.

    One instance per worker process wraps its whole KV cache, a tensor of shape
    ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (axis 1: 0 = K, 1 = V)
    with dtype ``layout.dtype``; each (layer, K/V, block) is one contiguous region of
    ``layout.block_bytes`` bytes. Two workers may differ in ``num_blocks`` only.

    Every instance can act on both sides:
    - sender (prefill): ``add_remote`` then ``write_blocks``;
    - receiver (decode): ``set_notification_handler``, then publish ``metadata()``.

    Thread-safety: every method may be called from any thread; ``write_blocks`` may run
    concurrently, to the same or different peers, and one receiver accepts concurrent writes
    from many senders. Writes to overlapping remote blocks at once are the caller's bug.

    Ownership: the transport reads/writes the cache tensor in place, never reallocates it; the
    caller keeps it alive until ``close()`` and must not resize it.
    """

    def __init__(self, kv_cache: torch.Tensor, layout: KVCacheLayout, *,
                 secret: str | None = None, require_grants: bool = False) -> None:
        """Register ``kv_cache`` once for all later transfers.

        ``secret``: the internal secret; both ends of a handshake must prove they know it
        (HMAC over fresh nonces or agent names), or the connection is refused. None: no check
        (internal ports unauthenticated). ``require_grants``: as a receiver, admit only writes
        carrying a token granted by ``grant_write`` (a decode worker); False: any write into
        valid block ids goes to the notification handler (a library user, the contract tests).

        Raises ValueError naming the mismatch when the tensor's rank, shape (other than
        ``num_blocks``), dtype or contiguity disagrees with ``layout``.
        """
        expected = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        if kv_cache.dim() != 6:
            raise ValueError(f"kv_cache must have 6 dims, got shape {tuple(kv_cache.shape)}")
        shape = tuple(kv_cache.shape)
        names = ("num_layers", "2 (K/V)", "block_size", "num_kv_heads", "head_dim")
        for name, want, got in zip(names, expected, shape[:2] + shape[3:]):
            if want != got:
                raise ValueError(f"kv_cache shape {shape}: {name} is {got}, layout says {want}")
        if kv_cache.dtype != layout.torch_dtype:
            raise ValueError(f"kv_cache dtype is {kv_cache.dtype}, layout says {layout.dtype}")
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous")
        self.kv_cache = kv_cache
        self.layout = layout
        self.num_blocks = shape[2]
        self.secret, self.require_grants = secret, require_grants
        self.grants = WriteGrants()
        # receiver: payload bytes of admitted writes that landed in the cache (a counter)
        self.bytes_received = 0
        self._received_lock = threading.Lock()
        self._handler: NotificationHandler | None = None
        self._handler_lock = threading.Lock()  # NOTE: held while a handler runs: one at a time

    # ---- both sides -------------------------------------------------------------------------

    @abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``add_remote``: how to reach this agent, its layout
        and ``num_blocks``. Stable for the transport's lifetime; safe to publish (Redis)."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving and drop all connections; idempotent. In-flight ``write_blocks`` calls
        fail with KVTransferError; later calls to any method except ``close`` raise it too."""

    # ---- sender side (prefill) --------------------------------------------------------------

    @abstractmethod
    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's ``metadata()``, connect and handshake; return the peer's name.

        Idempotent: the same peer's metadata returns the same name without a new handshake.
        Raises KVLayoutMismatchError (naming every differing field: block_size, dtype,
        num_layers, num_kv_heads, head_dim) when the layouts differ (both sides check and
        refuse), KVTransferError when the metadata is invalid or the peer is unreachable.
        """

    def write_blocks(self, peer: str, local_block_ids: Sequence[int],
                     remote_block_ids: Sequence[int], notification: bytes, timeout_s: float,
                     *, token: bytes = b"") -> None:
        """Copy local block ``local_block_ids[i]`` into the peer's ``remote_block_ids[i]`` for
        every layer and both K and V, then deliver ``notification`` to the peer's handler.

        Blocking: returns only after every byte landed in the peer's cache and the peer's
        notification handler returned. No other remote block is touched. An empty id list
        only delivers the notification. ``token``: the reservation's write token (a receiver
        with ``require_grants`` refuses any write without a valid one, touching nothing).

        Raises ValueError when the lists differ in length or a local id is out of
        ``[0, num_blocks)`` or ids repeat (caller bug; nothing is sent). Raises
        KVTransferError on anything else, never later than ``timeout_s`` seconds after the
        call: unknown peer, remote ids out of the peer's range (refused by the peer, which
        keeps serving), no handler on the peer, handler raised, connection lost, timeout.
        After a failure the content of the remote blocks is unspecified. A failure does not
        prove the notification was not delivered (e.g. the ack was lost), so receivers must
        tolerate a notification for a handoff the sender reports as failed.
        """
        deadline = time.monotonic() + timeout_s
        if len(notification) > MAX_NOTIFICATION_BYTES:
            raise ValueError(f"notification of {len(notification)} bytes > "
                             f"{MAX_NOTIFICATION_BYTES}")
        local_ids = [operator.index(b) for b in local_block_ids]
        remote_ids = [operator.index(b) for b in remote_block_ids]
        if len(local_ids) != len(remote_ids):
            raise ValueError(f"{len(local_ids)} local block ids but {len(remote_ids)} remote")
        if problem := invalid_block_ids(local_ids, self.num_blocks):
            raise ValueError(f"local {problem}")
        if len(set(remote_ids)) != len(remote_ids):
            raise ValueError("remote block ids contain duplicates")
        self._write(peer, local_ids, remote_ids, notification, bytes(token), timeout_s, deadline)

    def renew_lease(self, peer: str, token: bytes, timeout_s: float) -> float:
        """Extend the lease of the peer's grant for ``token`` (the sender is still computing
        the prompt); returns the seconds now left. Raises KVTransferError when refused (token
        unknown or used, lease already ended), the peer is unknown or gone, or on timeout;
        KVLeaseRefusedError (a KVTransferError) when the peer answered no: the reservation is
        gone or its stream is, so nothing written into it would be used."""
        reply = self._send_renewal(peer, bytes(token), time.monotonic() + timeout_s)
        if not reply.get("ok"):
            raise KVLeaseRefusedError(f"peer {peer} refused the lease renewal: {reply.get('error')}")
        return float(reply["lease_s"])

    @abstractmethod
    def _send_renewal(self, peer: str, token: bytes, deadline: float) -> dict:
        """Ask ``peer`` to renew ``token``'s lease; its answer (``_renew`` on the peer)."""

    @abstractmethod
    def _write(self, peer: str, local_ids: list[int], remote_ids: list[int],
               notification: bytes, token: bytes, timeout_s: float, deadline: float) -> None:
        """The backend's ``write_blocks`` after the shared argument checks (ids are ints,
        equal in number, local ones valid, remote ones distinct); ``deadline`` is
        ``time.monotonic()`` at the call plus ``timeout_s``."""

    # ---- receiver side (decode), shared by every backend --------------------------------------

    def set_notification_handler(self, handler: NotificationHandler) -> None:
        """Call ``handler(notification)`` once per completed write, after all its blocks landed
        (without ``require_grants``; with it, each grant's own ``on_write`` runs instead).

        Called from a transport thread, one call at a time (calls never overlap); it should be
        quick (e.g. enqueue for the scheduler) and must not call this transport. If it raises,
        the sender's ``write_blocks`` raises KVTransferError with its message. Set it before
        publishing ``metadata()``: writes that arrive with no handler set are refused.
        """
        with self._handler_lock:
            self._handler = handler

    def grant_write(self, token: bytes, block_ids: Sequence[int], lease_s: float,
                    on_write: NotificationHandler,
                    on_lost: Callable[[str], None] | None = None) -> None:
        """Accept one write with ``token`` into exactly ``block_ids`` (or a notification-only
        write) before the lease of ``lease_s`` seconds ends; the sender may renew it. Then
        ``on_write(notification)`` runs as a handler does; ``on_lost(reason)`` when an admitted
        write broke off after it may have touched the blocks. Raises ValueError on bad ids, a
        short or reused token, a lease that is not positive."""
        if problem := invalid_block_ids(list(block_ids), self.num_blocks):
            raise ValueError(f"block_ids: {problem}")
        self.grants.grant(token, block_ids, lease_s, on_write, on_lost)

    def lease_left(self, token: bytes) -> float:  # see WriteGrants.lease_left
        return self.grants.lease_left(token)

    def stop_renewals(self, token: bytes) -> None:  # the stream went away: let the lease run out
        self.grants.stop_renewals(token)

    def revoke(self, token: bytes) -> None:  # the reservation closed: admit no write any more
        self.grants.close(token)

    def _check_welcome(self, peer: str, reply: dict, *proof_parts) -> None:
        """Sender side: the receiver's answer to our handshake. Raises KVLayoutMismatchError
        (naming the fields), or KVTransferError when refused or the receiver cannot prove the
        internal secret (HMAC over ``proof_parts``, labelled "kv-ack")."""
        if reply.get("fields"):
            raise KVLayoutMismatchError(str(reply.get("error")), reply["fields"])
        if not reply.get("ok"):
            raise KVTransferError(f"peer {peer} refused the handshake: {reply.get('error')}")
        if not proof_ok(self.secret, reply.get("proof"), "kv-ack", *proof_parts):
            raise KVTransferError(f"peer {peer} does not prove the internal secret")

    def _check_hello(self, peer: str, layout: object, proof: object, *proof_parts) -> dict | None:
        """A sender's handshake: None when accepted, else the refusal to send (logged with
        ``peer``, its address): its layout differs (naming the fields) or it cannot prove the
        internal secret (HMAC over ``proof_parts``, labelled "kv-hello")."""
        if not proof_ok(self.secret, proof, "kv-hello", *proof_parts):
            logger.warning("refused a KV transfer connection from %s: it does not prove the "
                           "internal secret", peer)
            return {"ok": False, "error": "internal secret not proven", "fields": []}
        try:
            check_layouts_match(self.layout, layout_from_dict(layout), peer)
        except KVTransferError as exc:
            logger.warning("refused a KV transfer connection from %s: %s", peer, exc)
            return {"ok": False, "error": str(exc), "fields": list(getattr(exc, "fields", ()))}
        return None

    def _admit_write(self, peer: str, token: bytes, ids: object) -> tuple[WriteGrant | None, str]:
        """Whether a write of ``ids`` with ``token`` from ``peer`` may land: (its grant, "")
        (grant None without ``require_grants``), or (None, why not), logged with ``peer``."""
        if not isinstance(ids, list):
            problem = "remote_block_ids must be a list"
        elif problem := invalid_block_ids(ids, self.num_blocks):
            problem = f"remote {problem}"
        elif self.require_grants:
            grant, problem = self.grants.admit(token, ids)
            if grant is not None:
                return grant, ""
        if problem:
            logger.warning("refused a KV write from %s into blocks %s: %s", peer,
                           ids[:16] if isinstance(ids, list) else "?", problem)
        return None, problem

    def _deliver(self, grant: WriteGrant | None, notification: bytes) -> dict:
        """Run the write's handler (its grant's, or the transport's) under the handler lock;
        the answer for the sender. A grant whose handler raised is reported lost."""
        error = None
        try:
            with self._handler_lock:
                handler = grant.on_write if grant is not None else self._handler
                if handler is None:
                    raise KVTransferError("receiver has no notification handler set")
                handler(notification)
        except Exception as exc:  # reported to the sender; the connection stays usable
            logger.warning("KV notification handler failed: %r", exc)
            error = f"notification handler: {exc!r}"
        if error is None:
            if grant is not None:
                self.grants.done(grant)
            return {"ok": True}
        self._write_lost(grant, error)
        return {"ok": False, "error": error}

    def _write_lost(self, grant: WriteGrant | None, reason: str) -> None:
        """An admitted write broke off or its notification was refused; nothing more of it
        lands: tell its grant's owner (the reservation closes as not written)."""
        if grant is None:
            return
        self.grants.done(grant)
        try:
            with self._handler_lock:
                if grant.on_lost is not None:
                    grant.on_lost(reason)
        except Exception:  # noqa: BLE001 - a transport thread must survive its callbacks
            logger.exception("KV write-lost callback failed")

    def _received(self, num_bytes: int) -> None:
        """An admitted write's ``num_bytes`` payload bytes landed (any receiving thread)."""
        with self._received_lock:
            self.bytes_received += num_bytes

    def _renew(self, peer: str, token: bytes) -> dict:
        """A sender's lease renewal for ``token``: the answer (``lease_s`` left, or refusal)."""
        lease_s = self.grants.renew(token)
        if lease_s is None:
            logger.warning("refused a KV lease renewal from %s: no open grant for the token", peer)
            return {"ok": False, "error": "no open reservation for this token"}
        return {"ok": True, "lease_s": lease_s}
