"""The one interface every KV-cache transfer backend implements (TCP and NIXL).

A prefill worker (sender) computes a prompt's KV cache into its own paged cache, then writes
those blocks into blocks a decode worker (receiver) reserved, with a notification; the decode
worker learns of completion only from that notification and then admits the sequence. What the
two engines do around that write (reserve, finish the remote prefill, hold and release) is
``handoff.EngineKVHooks``.

The shape follows NIXL's agent model so a NIXL backend fits without changing callers:
register the whole cache once (``__init__``), publish opaque agent metadata (``metadata``),
load a peer's metadata (``add_remote``), then one WRITE with a notification per handoff
(``write_blocks``); the receiver is told by its notification handler, never by polling memory.
The receiving side every backend shares is ``receiver.KVReceiver``.
"""
from __future__ import annotations

import operator
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from kernels.kv_layout import KVCacheLayout
from services.kv_transfer.block_ids import (check_layer_starts, invalid_block_ids,
                                            layer_block_count)
from services.kv_transfer.errors import KVLayoutMismatchError, KVLeaseRefusedError, KVTransferError
from services.kv_transfer.grants import proof_ok
from services.kv_transfer.receiver import KVReceiver, NotificationHandler

MAX_NOTIFICATION_BYTES = 1 << 20  # largest write_blocks notification, every backend


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
        self.secret = secret
        self.receiver = KVReceiver(layout, self.num_blocks, secret=secret,
                                   require_grants=require_grants)

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
                     *, token: bytes = b"", layer_starts: Sequence[int] | None = None) -> int:
        """Copy local block ``local_block_ids[i]`` into the peer's ``remote_block_ids[i]`` for
        every layer and both K and V, then deliver ``notification`` to the peer's handler;
        returns the payload bytes written.

        ``layer_starts`` (one int per layer, each in ``[0, len(ids)]``): layer ``l`` copies
        only the pairs from position ``layer_starts[l]`` on, and leaves its part of the earlier
        remote blocks as it was (a sliding-window layer's blocks before its window, which no
        later token reads, while the model's global layers need them: Gemma).

        Blocking: returns only after every byte landed in the peer's cache and the peer's
        notification handler returned. No other remote block is touched. An empty id list
        only delivers the notification. ``token``: the reservation's write token (a receiver
        with ``require_grants`` refuses any write without a valid one, touching nothing).

        Raises ValueError when the lists differ in length, a local id is out of
        ``[0, num_blocks)``, ids repeat or ``layer_starts`` is malformed (caller bug; nothing
        is sent). Raises KVTransferError on anything else, never later than ``timeout_s`` seconds after the
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
        starts, problem = check_layer_starts(layer_starts, self.layout.num_layers, len(local_ids))
        if problem:
            raise ValueError(problem)
        self._write(peer, local_ids, remote_ids, notification, bytes(token), timeout_s, deadline,
                    starts)
        return self._payload_bytes(starts, len(local_ids))

    def _payload_bytes(self, layer_starts: Sequence[int], num_ids: int) -> int:
        """Bytes a write of ``num_ids`` blocks with valid ``layer_starts`` copies (K and V)."""
        return layer_block_count(layer_starts, num_ids) * 2 * self.layout.block_bytes

    def _incoming_layers(self, ids: object, layer_starts: object,
                         ) -> tuple[tuple[int, ...], int, str | None]:
        """Receiver side: a write's ``layer_starts`` as sent, checked against its remote
        ``ids`` (anything: the receiver refuses what is not a list), with the payload bytes
        they mean and why they are invalid (None: they are not; then the bytes are 0)."""
        num_ids = len(ids) if isinstance(ids, list) else 0
        starts, problem = check_layer_starts(layer_starts, self.layout.num_layers, num_ids)
        return starts, 0 if problem else self._payload_bytes(starts, num_ids), problem

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
        """Ask ``peer`` to renew ``token``'s lease; its answer (``KVReceiver.renew`` on the peer)."""

    @abstractmethod
    def _write(self, peer: str, local_ids: list[int], remote_ids: list[int],
               notification: bytes, token: bytes, timeout_s: float, deadline: float,
               layer_starts: tuple[int, ...]) -> None:
        """The backend's ``write_blocks`` after the shared argument checks (ids are ints,
        equal in number, local ones valid, remote ones distinct; ``layer_starts`` valid, one
        per layer); ``deadline`` is ``time.monotonic()`` at the call plus ``timeout_s``."""

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

    # ---- receiver side (decode): receiver.KVReceiver ----------------------------------------

    @property
    def bytes_received(self) -> int:
        """Payload bytes of admitted writes that landed in this cache (a counter)."""
        return self.receiver.bytes_received

    def set_notification_handler(self, handler: NotificationHandler) -> None:
        """Call ``handler(notification)`` once per completed write, after all its blocks landed
        (without ``require_grants``; with it, each grant's own ``on_write`` runs instead).

        Called from a transport thread, one call at a time (calls never overlap); it should be
        quick (e.g. enqueue for the scheduler) and must not call this transport. If it raises,
        the sender's ``write_blocks`` raises KVTransferError with its message. Set it before
        publishing ``metadata()``: writes that arrive with no handler set are refused.
        """
        self.receiver.set_notification_handler(handler)

    def grant_write(self, token: bytes, block_ids: Sequence[int], lease_s: float,
                    on_write: NotificationHandler,
                    on_lost: Callable[[str], None] | None = None) -> None:
        """Accept one write with ``token`` into exactly ``block_ids`` (or a notification-only
        write) before the lease of ``lease_s`` seconds ends; the sender may renew it. Then
        ``on_write(notification)`` runs as a handler does; ``on_lost(reason)`` when an admitted
        write broke off after it may have touched the blocks. Raises ValueError on bad ids, a
        short or reused token, a lease that is not positive."""
        self.receiver.grant_write(token, block_ids, lease_s, on_write, on_lost)

    def lease_left(self, token: bytes) -> float:  # see WriteGrants.lease_left
        return self.receiver.grants.lease_left(token)

    def stop_renewals(self, token: bytes) -> None:  # the stream went away: let the lease run out
        self.receiver.grants.stop_renewals(token)

    def revoke(self, token: bytes) -> None:  # the reservation closed: admit no write any more
        self.receiver.grants.close(token)
