"""The errors a KV transfer raises, every backend alike."""
from __future__ import annotations

from collections.abc import Sequence


class KVTransferError(RuntimeError):
    """A transfer or handshake failed: peer unreachable or gone, timeout, refusal, bad ids."""


class KVLeaseRefusedError(KVTransferError):
    """The receiver refused to renew a reservation's lease: it is closed, used, ended, or its
    stream has gone. Nothing written into it would be used."""


class KVLayoutMismatchError(KVTransferError):
    """Two workers' KV layouts differ, so blocks cannot move between them.

    ``fields`` names every differing ``KVCacheLayout`` field, e.g. ``("block_size", "dtype")``.
    """

    def __init__(self, message: str, fields: Sequence[str]) -> None:
        super().__init__(message)
        self.fields = tuple(fields)
