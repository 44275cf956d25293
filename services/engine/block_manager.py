"""Paged KV cache bookkeeping: a pool of fixed-size blocks and each request's block table.

PagedAttention (Kwon et al., SOSP 2023, section 4.2): KV is stored in blocks of ``block_size``
tokens allocated on demand, so a sequence wastes at most the unused slots of its last block.
"""
from __future__ import annotations

from collections import deque

from .request import Request


class BlockManager:
    """Allocates and frees KV blocks for requests.

    Block ids index axis 2 of the KV cache tensor
    ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``. The free list is a
    deque, so allocate and free are O(1) per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (ceiling division)."""
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow ``request.block_table`` to hold ``num_computed_tokens + num_new_tokens`` tokens.

        Returns False (and allocates nothing) when too few blocks are free.
        """
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        missing = needed - len(request.block_table)
        if missing <= 0:
            return True
        if missing > len(self._free):
            return False
        request.block_table.extend(self._free.popleft() for _ in range(missing))
        return True

    def free(self, request: Request) -> None:
        """Return every block of ``request`` to the pool and clear its block table."""
        self._free.extend(request.block_table)
        request.block_table = []
