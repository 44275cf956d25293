"""The one interface every KV-cache transfer backend implements (TCP now, NIXL later).

A prefill worker (sender) computes a prompt's KV cache into its own paged cache, then writes
those blocks into blocks a decode worker (receiver) reserved, with a notification; the decode
worker learns of completion only from that notification and then admits the sequence.

The shape follows NIXL's agent model so a NIXL backend fits without changing callers:
register the whole cache once (``__init__``), publish opaque agent metadata (``metadata``),
load a peer's metadata (``add_remote``), then one WRITE with a notification per handoff
(``write_blocks``); the receiver is told by its notification handler, never by polling memory.
"""
from __future__ import annotations

import dataclasses
import operator
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from kernels.kv_layout import KVCacheLayout

NotificationHandler = Callable[[bytes], None]


class KVTransferError(RuntimeError):
    """A transfer or handshake failed: peer unreachable or gone, timeout, refusal, bad ids."""


class KVLayoutMismatchError(KVTransferError):
    """Two workers' KV layouts differ, so blocks cannot move between them.

    ``fields`` names every differing ``KVCacheLayout`` field, e.g. ``("block_size", "dtype")``.
    """

    def __init__(self, message: str, fields: Sequence[str]) -> None:
        super().__init__(message)
        self.fields = tuple(fields)


def layout_to_dict(layout: KVCacheLayout) -> dict:
    return dataclasses.asdict(layout)


def layout_from_dict(data: dict) -> KVCacheLayout:
    """Raises KVTransferError when ``data`` lacks a field or carries an unknown one."""
    try:
        return KVCacheLayout(**data)
    except TypeError as exc:
        raise KVTransferError(f"peer sent an invalid KV layout {data!r}: {exc}") from exc


def check_layouts_match(local: KVCacheLayout, remote: KVCacheLayout, peer: str) -> None:
    """Raises KVLayoutMismatchError naming every field where ``local`` and ``remote`` differ."""
    diffs = [
        (f.name, getattr(local, f.name), getattr(remote, f.name))
        for f in dataclasses.fields(KVCacheLayout)
        if getattr(local, f.name) != getattr(remote, f.name)
    ]
    if diffs:
        detail = "; ".join(f"{name}: local={a!r} remote={b!r}" for name, a, b in diffs)
        raise KVLayoutMismatchError(
            f"KV cache layout mismatch with peer {peer}: {detail}", [d[0] for d in diffs]
        )


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Coalesce ids into ``(first_id, count)`` runs of consecutive ids, keeping list order.

    ``[4, 5, 6, 9, 2, 3]`` -> ``[(4, 3), (9, 1), (2, 2)]``.
    """
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


MAX_NOTIFICATION_BYTES = 1 << 20  # largest write_blocks notification, every backend


def invalid_block_ids(block_ids: Sequence[int], num_blocks: int) -> str | None:
    """Why ``block_ids`` cannot be written into a cache of ``num_blocks`` blocks, or None."""
    if any(type(b) is not int for b in block_ids):
        return "block ids must be ints"
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        return f"block ids {bad[:8]} out of range [0, {num_blocks})"
    if len(set(block_ids)) != len(block_ids):
        return "block ids contain duplicates"
    return None


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

    def __init__(self, kv_cache: torch.Tensor, layout: KVCacheLayout) -> None:
        """Register ``kv_cache`` once for all later transfers.

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

    def write_blocks(
        self,
        peer: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notification: bytes,
        timeout_s: float,
    ) -> None:
        """Copy local block ``local_block_ids[i]`` into the peer's ``remote_block_ids[i]`` for
        every layer and both K and V, then deliver ``notification`` to the peer's handler.

        Blocking: returns only after every byte landed in the peer's cache and the peer's
        notification handler returned. No other remote block is touched. An empty id list
        only delivers the notification.

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
        self._write(peer, local_ids, remote_ids, notification, timeout_s, deadline)

    @abstractmethod
    def _write(self, peer: str, local_ids: list[int], remote_ids: list[int],
               notification: bytes, timeout_s: float, deadline: float) -> None:
        """The backend's ``write_blocks`` after the shared argument checks (ids are ints,
        equal in number, local ones valid, remote ones distinct); ``deadline`` is
        ``time.monotonic()`` at the call plus ``timeout_s``."""

    # ---- receiver side (decode) -------------------------------------------------------------

    @abstractmethod
    def set_notification_handler(self, handler: NotificationHandler) -> None:
        """Call ``handler(notification)`` once per completed write, after all its blocks landed.

        Called from a transport thread, one call at a time (calls never overlap); it should be
        quick (e.g. enqueue for the scheduler) and must not call this transport. If it raises,
        the sender's ``write_blocks`` raises KVTransferError with its message. Set it before
        publishing ``metadata()``: writes that arrive with no handler set are refused.
        """
