"""The block ids a write names: checked against a cache's size, and coalesced into runs of
consecutive ids (one copy per run)."""
from __future__ import annotations

from collections.abc import Sequence


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
