"""The receiving side of a KV transfer, shared by every backend (a decode worker's): the
handshake's layout and secret checks, the admission of a write (block ids in range; with
``require_grants``, a granted single-use token, see ``grants.py``), lease renewals, and running
the write's notification handler, one at a time.

A backend receives bytes its own way (TCP frames, NIXL notifications) and asks its
``KVReceiver`` at each step: ``check_hello`` on a handshake, ``admit_write`` before a byte lands,
``received`` after, ``deliver`` for the notification, ``write_lost`` when an admitted write broke
off, ``renew`` on a lease renewal. Every method may be called from any transport thread.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kernels.kv_layout import KVCacheLayout
from services.kv_transfer.block_ids import invalid_block_ids
from services.kv_transfer.errors import KVTransferError
from services.kv_transfer.grants import WriteGrant, WriteGrants, proof_ok
from services.kv_transfer.layouts import check_layouts_match, layout_from_dict

logger = logging.getLogger(__name__)

NotificationHandler = Callable[[bytes], None]


class KVReceiver:
    """Which writes into a cache of ``num_blocks`` blocks of ``layout`` may land, and who is
    told when one has. ``secret``, ``require_grants``: see ``KVTransport.__init__``."""

    def __init__(self, layout: KVCacheLayout, num_blocks: int, *, secret: str | None,
                 require_grants: bool) -> None:
        self.layout, self.num_blocks = layout, num_blocks
        self.secret, self.require_grants = secret, require_grants
        self.grants = WriteGrants()
        self.bytes_received = 0  # payload bytes of admitted writes that landed in the cache
        self._received_lock = threading.Lock()
        self._handler: NotificationHandler | None = None
        self._handler_lock = threading.Lock()  # NOTE: held while a handler runs: one at a time

    def set_notification_handler(self, handler: NotificationHandler) -> None:
        """See ``KVTransport.set_notification_handler``."""
        with self._handler_lock:
            self._handler = handler

    def grant_write(self, token: bytes, block_ids: Sequence[int], lease_s: float,
                    on_write: NotificationHandler,
                    on_lost: Callable[[str], None] | None = None) -> None:
        """See ``KVTransport.grant_write``. Raises ValueError on bad ids, a short or reused
        token, a lease that is not positive."""
        if problem := invalid_block_ids(list(block_ids), self.num_blocks):
            raise ValueError(f"block_ids: {problem}")
        self.grants.grant(token, block_ids, lease_s, on_write, on_lost)

    def check_hello(self, peer: str, layout: object, proof: object, *proof_parts) -> dict | None:
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

    def admit_write(self, peer: str, token: bytes, ids: object) -> tuple[WriteGrant | None, str]:
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

    def received(self, num_bytes: int) -> None:
        """An admitted write's ``num_bytes`` payload bytes landed (any receiving thread)."""
        with self._received_lock:
            self.bytes_received += num_bytes

    def deliver(self, grant: WriteGrant | None, notification: bytes) -> dict:
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
        self.write_lost(grant, error)
        return {"ok": False, "error": error}

    def write_lost(self, grant: WriteGrant | None, reason: str) -> None:
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

    def renew(self, peer: str, token: bytes) -> dict:
        """A sender's lease renewal for ``token``: the answer (``lease_s`` left, or refusal)."""
        lease_s = self.grants.renew(token)
        if lease_s is None:
            logger.warning("refused a KV lease renewal from %s: no open grant for the token", peer)
            return {"ok": False, "error": "no open reservation for this token"}
        return {"ok": True, "lease_s": lease_s}
