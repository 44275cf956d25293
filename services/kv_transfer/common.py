"""What both KV transport backends share besides the interface: error types, layout
(de)serialisation and comparison, block-id checks and runs."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kernels.kv_layout import KVCacheLayout

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
