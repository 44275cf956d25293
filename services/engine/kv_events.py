"""KV events: what a worker's prefix cache stores and evicts, named by the chained block hashes
the cache itself uses, so that a router can tell which worker already holds a prompt's prefix.

The event kinds are vLLM's (``vllm/distributed/kv_events.py``: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``) and what NVIDIA Dynamo's ``KvIndexer`` consumes: an index
rebuilt from the log alone is the worker's cache. ``BlockManager`` records into a ``KVEventLog``
on the engine thread (one deque append per block); a publisher on another thread drains it
(``services/state/kv_events.py`` carries the batches over Redis Streams).

Block hash: ``hash((parent_hash, block_tokens))`` chained from ``ROOT_HASH`` over full blocks
(``block_hash``), the prefix cache's own key (``block_manager.py``). Python's hash of a tuple of
ints is the same in every process of one interpreter version (``PYTHONHASHSEED`` salts str and
bytes only), so the gateway computes the same chain from the token ids (``prompt_block_hashes``)
without asking a worker. A collision can only mislead routing: a worker accepts a cache hit
only when the block holds exactly the prompt's tokens.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

ROOT_HASH = 0  # parent hash of a sequence's first block
HASH_SCHEME = "python-tuple-hash-v1"  # how block hashes are computed (in the stream's header)

STORED, REMOVED = "stored", "removed"


def block_hash(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """The prefix-cache key of a full block of ``tokens`` whose prefix hashes to ``parent_hash``."""
    return hash((parent_hash, tokens))


def prompt_block_hashes(token_ids: Sequence[int], block_size: int,
                        max_blocks: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` that a worker's prefix cache can hit:
    at most ``(len - 1) // block_size`` (the last token is always computed, for its logits),
    and at most ``max_blocks``. O(len(token_ids)).

    Raises ValueError when ``block_size`` is not positive."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    n = (len(token_ids) - 1) // block_size if token_ids else 0
    if max_blocks is not None:
        n = min(n, max_blocks)
    out, parent = [], ROOT_HASH
    for i in range(n):
        parent = block_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out


class KVEventLog:
    """Events of one prefix cache in the order they happened: ``(STORED, hash)`` when a full
    block enters the cache, ``(REMOVED, hash)`` when it is evicted.

    Thread-safety: one writer (the engine thread) appends, one reader drains; ``deque`` append
    and ``popleft`` are atomic, so neither takes a lock. Unbounded here: the reader drains it
    every few milliseconds and bounds what it keeps itself (``services/state/kv_events.py``).
    """

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: deque[tuple[str, int]] = deque()

    def stored(self, h: int) -> None:
        self._events.append((STORED, h))

    def removed(self, h: int) -> None:
        self._events.append((REMOVED, h))

    def drain(self) -> list[tuple[str, int]]:
        """Every event recorded so far, oldest first; they are gone from the log."""
        out, pop = [], self._events.popleft
        for _ in range(len(self._events)):
            out.append(pop())
        return out

    def __len__(self) -> int:
        return len(self._events)
