"""API keys at the gateway: who may use it, and which key a request belongs to.

Keys come from ``gateway.api_key`` (one plaintext key, ``--api-key`` / ``TANDEM_API_KEY``) and
``gateway.api_keys_file`` (``TANDEM_API_KEYS_FILE``: one SHA-256 hex digest of a key per line,
an optional name after it, ``#`` comments; what a mounted Kubernetes Secret holds). The file is
re-read when its identity or contents change (``os.stat`` of the path, following symlinks, on
every check: Kubernetes swaps a Secret's ``..data`` symlink, which changes the inode); a file
that cannot be read or parsed keeps the last good set, logged, so a half-written update never
opens or empties the gateway. Neither configured: the gateway is open (as vLLM without
``--api-key``) and every request belongs to the anonymous key id ``""``.

A presented key is hashed and compared with every digest by ``hmac.compare_digest`` (constant
time, no early exit); neither keys nor digests are ever logged. A request is owned by its
*key id*: a short hash of the key's digest (``key_id``), safe to store in Redis and to log.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)

DIGEST_RE = re.compile(r"^[0-9a-fA-F]{64}$")


class Unauthenticated(Exception):
    """No API key, or one the gateway does not accept; maps to HTTP 401 / UNAUTHENTICATED."""


@dataclass(frozen=True)
class Identity:
    """Who sent a request: ``key_id`` (``""``: anonymous, the gateway is open) and ``name``
    (the keys file's label, or ``api-key`` for ``gateway.api_key``; for logs)."""
    key_id: str
    name: str


ANONYMOUS = Identity("", "anonymous")


def key_digest(key: str) -> str:
    """SHA-256 hex digest of ``key`` (UTF-8): what the keys file holds."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(digest: str) -> str:
    """The key id of a key whose digest is ``digest``: 16 hex characters of a hash over it."""
    return hashlib.sha256(b"tandem-key-id\0" + digest.lower().encode()).hexdigest()[:16]


def bearer_token(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` value (scheme case-insensitive), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def parse_keys_file(text: str, path: str) -> dict[str, Identity]:
    """Digest (lower-case hex) -> Identity of every line of a keys file.

    Raises ValueError naming ``path`` and the line for a line that is not a SHA-256 hex digest."""
    out: dict[str, Identity] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        digest, _, name = line.partition(" ")
        if not DIGEST_RE.match(digest):
            raise ValueError(f"gateway.api_keys_file: {path} line {number}: not a SHA-256 hex "
                             "digest (64 hex characters; store sha256(key), never the key)")
        digest = digest.lower()
        out[digest] = Identity(key_id(digest), name.strip() or f"key-{key_id(digest)[:8]}")
    return out


class ApiKeys:
    """The accepted keys: ``authenticate(key) -> Identity`` or Unauthenticated.

    ``api_key`` is a plaintext key, ``keys_file`` a path (see the module docstring). Raises
    ValueError naming the setting when the file cannot be read or parsed at construction."""

    def __init__(self, api_key: str | None = None, keys_file: str | None = None) -> None:
        if api_key is not None and not api_key.strip():
            raise ValueError("gateway.api_key: empty")
        self.keys_file = keys_file
        self._fixed: dict[str, Identity] = {}
        if api_key is not None:
            digest = key_digest(api_key.strip())
            self._fixed[digest] = Identity(key_id(digest), "api-key")
        self._from_file: dict[str, Identity] = {}
        self._signature: tuple | None = None  # stat of the file the keys were read from
        self._bad_signature: tuple | None = None  # stat of a file that did not parse (logged once)
        if keys_file is not None:
            self._reload(strict=True)

    @property
    def enabled(self) -> bool:
        """False when no key is configured: every request is ANONYMOUS."""
        return bool(self._fixed) or self.keys_file is not None

    def authenticate(self, key: str | None) -> Identity:
        """The identity of ``key`` (the Bearer token). Raises Unauthenticated (missing or not
        accepted). Constant time in the key; the file is re-checked first (one ``stat``)."""
        if not self.enabled:
            return ANONYMOUS
        if not key:
            raise Unauthenticated("no API key: send `Authorization: Bearer KEY`")
        if self.keys_file is not None:
            self._reload(strict=False)
        digest = key_digest(key).encode()
        found = None
        for candidate, identity in (*self._fixed.items(), *self._from_file.items()):
            if hmac.compare_digest(digest, candidate.encode()):
                found = identity  # NOTE: no break: the time does not depend on which matched
        if found is None:
            raise Unauthenticated("API key not accepted")
        return found

    def _reload(self, strict: bool) -> None:
        """Re-read the keys file if its stat changed. ``strict``: raise ValueError on failure
        (start-up); else keep the last good keys and log."""
        path, signature = self.keys_file, None
        try:
            st = os.stat(path)
            signature = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, st.st_ctime_ns)
            if signature in (self._signature, self._bad_signature):
                return
            with open(path, encoding="utf-8") as f:
                keys = parse_keys_file(f.read(), path)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            message = (f"gateway.api_keys_file: cannot read {path!r}: {exc.strerror}"
                       if isinstance(exc, OSError) else str(exc))
            if strict:
                raise ValueError(message) from None
            bad = signature or ("unreadable",)
            if bad != self._bad_signature:  # logged once per bad version of the file
                log.error("%s; keeping the %d keys read before", message, len(self._from_file))
            self._bad_signature = bad
            return
        if self._signature is not None:
            log.info("API keys file %s re-read: %d keys", path, len(keys))
        self._bad_signature = None
        self._from_file, self._signature = keys, signature
