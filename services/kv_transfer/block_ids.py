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


def check_layer_starts(layer_starts: Sequence[int] | None, num_layers: int,
                       num_ids: int) -> tuple[tuple[int, ...], str | None]:
    """A write's per-layer first positions in its id lists (layer ``l`` copies the blocks from
    position ``layer_starts[l]`` on; None: every layer copies every block), and why they are
    invalid (None if they are not): one int per layer, each in ``[0, num_ids]``."""
    if layer_starts is None:
        return (0,) * num_layers, None
    starts = tuple(layer_starts)
    if len(starts) != num_layers or any(type(s) is not int for s in starts):
        return starts, f"layer_starts: expected {num_layers} ints, one per layer"
    if any(not 0 <= s <= num_ids for s in starts):
        return starts, f"layer_starts: each must lie in [0, {num_ids}] (the write's blocks)"
    return starts, None


def layer_block_count(layer_starts: Sequence[int], num_ids: int) -> int:
    """(layer, block) pairs a write copies, each once for K and once for V."""
    return sum(num_ids - s for s in layer_starts)
