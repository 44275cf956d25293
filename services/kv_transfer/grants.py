"""Receiver-side authorisation of KV writes: which writes a decode worker accepts.

A decode worker that reserves blocks for a prompt *grants* one write into them: an unguessable
token (``new_token()``, 128 random bits) bound to the reservation's block ids and a lease. The
token travels in the reservation (gateway -> prefill worker) and back with the write. A write is
admitted only with a granted token, only into exactly that grant's block ids (or none: a
notification-only close), only once, and only before the lease ends; anything else is refused
before a byte lands (TCP), or before the notification is acted on (NIXL). The sender renews the
lease while it computes (``renew``), so a long prompt is never computed twice.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TOKEN_BYTES = 16
WRITING_POLL_S = 0.05  # lease_left of an admitted write still landing: ask again soon


def new_token() -> bytes:
    """A fresh write token: 16 bytes from the OS's CSPRNG (``secrets``)."""
    return secrets.token_bytes(TOKEN_BYTES)


@dataclass
class WriteGrant:
    """One reservation's permission to be written once.

    ``on_write(notification)`` runs (on a transport thread, one call at a time) once the write's
    blocks landed; ``on_lost(reason)`` once an admitted write failed on the receiver after it
    may have touched the blocks (nothing more of it can land; TCP only).
    """

    block_ids: tuple[int, ...]
    lease_s: float  # seconds each renewal extends the lease by
    expires_at: float  # time.monotonic() at which the lease ends
    on_write: Callable[[bytes], None]
    on_lost: Callable[[str], None] | None = None
    state: str = "open"  # "open" -> "writing" -> "done" -> "closed"; or "open" -> "closed"
    renewable: bool = True  # False once the reservation's stream has gone: the lease runs out


class WriteGrants:
    """The open grants of one receiver, by token. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._grants: dict[bytes, WriteGrant] = {}

    def __len__(self) -> int:
        return len(self._grants)

    def grant(self, token: bytes, block_ids: Sequence[int], lease_s: float,
              on_write: Callable[[bytes], None],
              on_lost: Callable[[str], None] | None = None) -> None:
        """Admit one write with ``token`` into ``block_ids`` for ``lease_s`` seconds (renewable).
        Raises ValueError for a short or reused token or a lease that is not positive."""
        if len(token) < TOKEN_BYTES:
            raise ValueError(f"token: {len(token)} bytes, at least {TOKEN_BYTES} required")
        if not lease_s > 0:
            raise ValueError(f"lease_s: {lease_s} must be > 0")
        grant = WriteGrant(tuple(block_ids), lease_s, time.monotonic() + lease_s, on_write,
                           on_lost)
        with self._lock:
            if token in self._grants:
                raise ValueError("token: already granted")
            self._grants[token] = grant

    def admit(self, token: bytes, block_ids: Sequence[int]) -> tuple[WriteGrant | None, str]:
        """Take the grant for a write of ``block_ids`` with ``token``: (grant, "") and the grant
        is used up, or (None, why it is refused)."""
        now = time.monotonic()
        with self._lock:
            grant = self._grants.get(bytes(token))
            if grant is None:
                return None, "no write is granted for this token"
            if grant.state != "open":
                return None, "the token was already used"
            if now >= grant.expires_at:
                return None, "the reservation's lease has ended"
            if block_ids and tuple(block_ids) != grant.block_ids:
                return None, "block ids are not the reservation's"
            grant.state = "writing"
            return grant, ""

    def done(self, grant: WriteGrant) -> None:
        """The admitted write has ended (landed and handled, or broke off)."""
        with self._lock:
            if grant.state == "writing":
                grant.state = "done"

    def renew(self, token: bytes) -> float | None:
        """Extend an open grant's lease to ``lease_s`` from now; its seconds left, or None when
        the token is unknown, used or its lease already ended (no renewal revives a lease)."""
        now = time.monotonic()
        with self._lock:
            grant = self._grants.get(bytes(token))
            if (grant is None or grant.state != "open" or not grant.renewable
                    or now >= grant.expires_at):
                return None
            grant.expires_at = now + grant.lease_s
            return grant.lease_s

    def lease_left(self, token: bytes) -> float:
        """Seconds until the grant's lease ends (0 once ended, closed or unknown); while an
        admitted write is still landing, at least ``WRITING_POLL_S``."""
        with self._lock:
            grant = self._grants.get(token)
            if grant is None or grant.state == "closed":
                return 0.0
            left = max(grant.expires_at - time.monotonic(), 0.0)
            # NOTE: an admitted write ends by the lease (TCP bounds its receive by it) and then
            # reports landed or lost; until it has, the blocks are not the caller's to free.
            return max(left, WRITING_POLL_S) if grant.state == "writing" else left

    def stop_renewals(self, token: bytes) -> None:
        """Refuse further renewals of ``token``'s lease (its stream has gone); writes are
        still admitted until the lease ends, so a write under way may finish."""
        with self._lock:
            if (grant := self._grants.get(token)) is not None:
                grant.renewable = False

    def close(self, token: bytes) -> None:
        """Forget the grant: no write is admitted with ``token`` any more (idempotent)."""
        with self._lock:
            grant = self._grants.pop(token, None)
            if grant is not None:
                grant.state = "closed"


def handshake_proof(secret: str | None, label: str, *parts: bytes | str) -> str:
    """Hex HMAC-SHA256 under the internal ``secret`` over ``label`` and ``parts`` (nonces,
    agent names): proves knowledge of the secret without sending it. "" without a secret."""
    if secret is None:
        return ""
    message = b"\0".join(p.encode() if isinstance(p, str) else bytes(p) for p in (label, *parts))
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def proof_ok(secret: str | None, proof: object, label: str, *parts: bytes | str) -> bool:
    """Whether ``proof`` is ``handshake_proof(secret, label, *parts)``, compared in constant
    time; always True without a secret (internal ports unauthenticated)."""
    if secret is None:
        return True
    expected = handshake_proof(secret, label, *parts)
    return isinstance(proof, str) and hmac.compare_digest(proof.encode(), expected.encode())
