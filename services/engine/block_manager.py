"""Paged KV cache bookkeeping: a pool of ref-counted blocks, each request's block table, and a
prefix cache over full blocks.

PagedAttention (Kwon et al., SOSP 2023, section 4.2): KV lives in blocks of ``block_size`` tokens
allocated on demand, so a sequence wastes at most the unused slots of its last block; section
4.4 shares blocks between sequences by reference count. The prefix cache follows vLLM v1's
KV cache manager (and nano-vllm's ``block_manager.py``): every full block is keyed by a hash
chained over the blocks before it, ``h = hash((parent_h, block_tokens))``
(``kv_events.block_hash``, the key KV events name blocks by), so one dict lookup per block finds
the longest cached prefix of a prompt.

Sliding-window attention on every layer (Mistral): ``free_blocks_outside_window`` frees a
sequence's leading blocks once no later token's window reaches them (vLLM's sliding-window KV
cache manager). Their entries stay in the block table, stale, so positions keep their blocks'
indices; attention never reads a block before the window, and ``free`` skips them.

NOTE: a hash can collide (Python's int hash is easy to invert), so a hit is accepted only when
the block holds exactly these tokens *and* its recorded parent is the cache entry matched for
the block before it. Each registration gets a fresh serial number and a block records its
parent's serial, so by induction a hit holds KV computed from exactly the query's prefix.
"""
from __future__ import annotations

from collections import OrderedDict
from itertools import count

from .kv_events import ROOT_HASH as _ROOT_HASH
from .kv_events import KVEventLog, block_hash
from .request import Request

_ROOT = 0  # parent serial of a sequence's first block (real serials start at 1)
_DEAD = -1  # serial of a chain that could not be registered (hash taken by other tokens)


class Block:
    """One physical KV block. ``hash`` is set while the block is in the prefix cache."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "serial", "parent_serial")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0  # requests whose block table holds this block
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()  # the block_size tokens whose KV it holds
        self.serial = _ROOT  # unique per registration; a child records its parent's
        self.parent_serial = _ROOT


class BlockManager:
    """Allocates, shares and frees KV blocks; caches full blocks by prefix hash.

    Block ids index axis 2 of the KV cache tensor
    ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.

    Free list: an ``OrderedDict`` of block ids. Allocation pops the head; a freed block that is
    in the prefix cache goes to the end (so the least recently freed cached block is evicted
    first, LRU), one that is not goes to the head (it holds nothing worth keeping). A prefix hit
    on a free cached block takes it out of the free list by key. Every operation is O(1) per
    block; a lookup is O(tokens looked up). Free blocks include cached ones: they are evictable.

    ``events``: where a block entering the prefix cache (stored) or leaving it (removed) is
    recorded, by its chained hash (``kv_events.py``); None records nothing.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 events: KVEventLog | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cache: dict[int, int] = {}  # chained hash -> block id
        # request (by identity) -> (full blocks registered, hash of the last, its entry's serial)
        self._chains: dict[Request, tuple[int, int, int]] = {}
        # request (by identity) -> leading block-table entries freed by the sliding window
        self._window_freed: dict[Request, int] = {}
        self._serials = count(1)
        self.events = events
        self.max_used_blocks = 0  # high-water mark of num_used_blocks (taken at each allocation)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, in use or free."""
        return len(self._cache)

    def cached_prefix_blocks(self, hashes: list[int]) -> int:
        """How many leading ``hashes`` (a prompt's chained block hashes) are in the cache: an
        estimate of ``get_computed_blocks`` without its token checks (for ordering only)."""
        n = 0
        while n < len(hashes) and hashes[n] in self._cache:
            n += 1
        return n

    def cached_hashes(self) -> list[int]:
        """The chained hash of every block in the prefix cache. Safe from another thread while
        the engine runs: copying a dict of int keys holds the GIL throughout."""
        return list(self._cache)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (ceiling division)."""
        return -(-num_tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> list[int]:
        """Ids of the cached blocks holding the longest prefix of ``request.all_token_ids``.

        At most ``(num_tokens - 1) // block_size`` blocks (vLLM v1): the last token is always
        recomputed, for its logits, into a block of the request's own, so a shared block is
        never written. A request that already holds blocks gets none. Nothing changes until
        ``allocate_slots`` takes the blocks.
        """
        bs = self.block_size
        parent_hash, parent_serial = _ROOT_HASH, _ROOT
        hits: list[int] = []
        if request.block_table:
            return hits
        for i in range((request.num_tokens - 1) // bs):
            tokens = tuple(request.token_slice(i * bs, (i + 1) * bs))
            h = block_hash(parent_hash, tokens)
            block_id = self._cache.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_serial != parent_serial or block.token_ids != tokens:
                break  # a hash collision
            hits.append(block_id)
            parent_hash, parent_serial = h, block.serial
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are full of computed tokens (KV written).

        Call after ``num_computed_tokens`` advanced. A block whose prefix is already cached in
        another block stays private (the first copy is the one shared).
        """
        bs = self.block_size
        num_full = min(request.num_computed_tokens // bs, len(request.block_table))
        done, parent_hash, parent_serial = self._chains.get(request, (0, _ROOT_HASH, _ROOT))
        if done >= num_full:
            return
        for i in range(done, num_full):
            tokens = tuple(request.token_slice(i * bs, (i + 1) * bs))
            h = block_hash(parent_hash, tokens)
            if parent_serial != _DEAD:
                block = self.blocks[request.block_table[i]]
                parent_serial = self._register(block, h, tokens, parent_serial)
            parent_hash = h
        self._chains[request] = (num_full, parent_hash, parent_serial)

    def _register(self, block: Block, h: int, tokens: tuple[int, ...], parent_serial: int) -> int:
        """Cache ``block`` under ``h``; returns the serial of the entry now standing for it."""
        cached_id = self._cache.get(h)
        if cached_id is None:
            block.hash, block.token_ids, block.parent_serial = h, tokens, parent_serial
            block.serial = next(self._serials)
            self._cache[h] = block.block_id
            if self.events is not None:
                self.events.stored(h)
            return block.serial
        cached = self.blocks[cached_id]
        if cached.token_ids == tokens and cached.parent_serial == parent_serial:
            return cached.serial  # same prefix computed twice: children chain to the first
        return _DEAD

    # -- allocation ------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | tuple[int, ...] = ()) -> bool:
        """Grow ``request.block_table`` to hold ``num_computed_tokens`` + the
        ``computed_blocks`` (prefix hits, appended and shared) + ``num_new_tokens`` tokens.

        Returns False (and changes nothing) when too few blocks are free; a hit on a free
        cached block costs one free block, a hit on a block in use costs none.
        """
        bs = self.block_size
        total = request.num_computed_tokens + len(computed_blocks) * bs + num_new_tokens
        if not computed_blocks and total <= len(request.block_table) * bs:
            return True  # a running request's usual step: its last block has room
        missing = max(self.blocks_needed(total) - len(request.block_table) - len(computed_blocks), 0)
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if missing + revived > len(self._free):
            return False
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        if computed_blocks:
            last = self.blocks[computed_blocks[-1]]
            self._chains[request] = (len(computed_blocks), last.hash, last.serial)
        request.block_table.extend(computed_blocks)
        request.block_table.extend(self._pop_free() for _ in range(missing))
        self.max_used_blocks = max(self.max_used_blocks, self.num_used_blocks)
        return True

    def allocate_each(self, requests: list[Request], num_new_tokens: int) -> bool:
        """``allocate_slots(r, num_new_tokens)`` for each of ``requests`` in order; False at
        the first that fails (the blocks given before it stay given). The usual case, a last
        block with room, is checked here: one call per step rather than per request."""
        bs = self.block_size
        return all(r.num_computed_tokens + num_new_tokens <= len(r.block_table) * bs
                   or self.allocate_slots(r, num_new_tokens) for r in requests)

    def _pop_free(self) -> int:
        """Take the head of the free list, evicting its prefix-cache entry if it has one."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self._cache.get(block.hash) == block_id:
                del self._cache[block.hash]
                if self.events is not None:
                    self.events.removed(block.hash)
            block.hash, block.token_ids, block.serial = None, (), _ROOT
        block.ref_count = 1
        return block_id

    def free(self, request: Request) -> None:
        """Drop the request's reference to each of its blocks and clear its block table.

        Blocks are released last first, so a sequence's tail is evicted before its head
        (vLLM v1): a head is the part other prompts are most likely to share.
        """
        skipped = self._window_freed.pop(request, 0)  # released already
        for block_id in reversed(request.block_table[skipped:]):
            self._release(block_id)
        request.block_table = []
        self._chains.pop(request, None)

    def _release(self, block_id: int) -> None:
        """Drop one reference; a block no one holds joins the free list (cached ones at the
        LRU end, others at the head)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.hash is None:
                self._free.move_to_end(block_id, last=False)

    # -- sliding window ----------------------------------------------------------------------
    def free_blocks_outside_window(self, request: Request, sliding_window: int) -> int:
        """Free the request's blocks that lie wholly before the window of every token still
        to be computed: its next token (position ``num_computed_tokens``) sees positions
        ``> num_computed_tokens - sliding_window``. Only for models whose every layer slides.

        Call after ``num_computed_tokens`` advanced (and after ``cache_full_blocks``: a freed
        block stays in the prefix cache until evicted). The entries stay in
        ``request.block_table``; returns the number of blocks freed by this call.
        """
        outside = min(self.blocks_before_window(request.num_computed_tokens, sliding_window),
                      len(request.block_table))
        done = self._window_freed.get(request, 0)
        if outside <= done:
            return 0
        for block_id in request.block_table[done:outside]:
            self._release(block_id)
        self._window_freed[request] = outside
        return outside - done

    def blocks_before_window(self, position: int, sliding_window: int) -> int:
        """Leading blocks wholly before the window of a token at ``position`` and every later
        one: it sees positions ``> position - sliding_window``."""
        return max(position - sliding_window + 1, 0) // self.block_size

    def never_cache(self, request: Request) -> None:
        """None of ``request``'s blocks enters the prefix cache from now on: some hold no KV
        (a remote prefill skipped the blocks before the window), and a chain cannot pass
        them. Blocks it shares from the cache stay cached."""
        self._chains[request] = (0, _ROOT_HASH, _DEAD)

    def num_window_freed(self, request: Request) -> int:
        """Leading entries of ``request.block_table`` already freed by the sliding window."""
        return self._window_freed.get(request, 0)
