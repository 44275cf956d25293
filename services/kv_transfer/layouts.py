"""A peer's KV cache layout: exchanged as a dict (TCP handshake, NIXL agent metadata) and
compared field by field, since blocks move only between caches of the same layout."""
from __future__ import annotations

import dataclasses

from kernels.kv_layout import KVCacheLayout
from services.kv_transfer.errors import KVLayoutMismatchError, KVTransferError


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
