"""Block manager: ref-counted paged allocation, the hash-chained prefix cache and its LRU free
list, with no model."""
from __future__ import annotations

import builtins

from services.engine import block_manager as bm_module
from services.engine.block_manager import BlockManager
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams

BS = 4
SP = SamplingParams(temperature=0, max_tokens=4)


def make(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, list(tokens), SP)


def computed(bm: BlockManager, tokens: list[int], rid: str = "r") -> Request:
    """A request whose whole prompt was computed (blocks allocated, full ones registered)."""
    r = make(tokens, rid)
    hits = bm.get_computed_blocks(r)
    assert bm.allocate_slots(r, len(tokens) - len(hits) * BS, hits)
    r.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(r)
    return r


def assert_pool_full(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_allocate_grows_on_demand_and_free_returns_every_block():
    bm = BlockManager(8, BS)
    r = make([1] * 5)
    assert bm.allocate_slots(r, 5) and len(r.block_table) == 2
    r.num_computed_tokens = 5
    assert bm.allocate_slots(r, 3) and len(r.block_table) == 2  # 8 tokens still fit in 2
    assert bm.allocate_slots(r, 4) and len(r.block_table) == 3
    assert bm.num_used_blocks == 3 and len(set(r.block_table)) == 3
    bm.free(r)
    assert r.block_table == [] and bm.num_free_blocks == 8


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(3, BS)
    cached = computed(bm, [1] * 8, "a")
    bm.free(cached)  # 2 cached free blocks + 1 plain free block
    r = make([1] * 8 + [2] * 9)
    hits = bm.get_computed_blocks(r)
    assert len(hits) == 2
    assert not bm.allocate_slots(r, 9, hits)  # 2 revived + 3 new > 3 free
    assert r.block_table == [] and bm.num_free_blocks == 3 and bm.num_cached_blocks == 2
    assert bm.allocate_slots(r, 4, hits) and r.block_table[:2] == hits


def test_shared_prefix_hits_and_ref_counts():
    bm = BlockManager(16, BS)
    system = [5, 6, 7, 8, 9, 10, 11, 12]
    a = computed(bm, system + [1, 2, 3], "a")
    assert bm.num_cached_blocks == 2  # the partial third block is not cached
    b = make(system + [4, 4, 4, 4, 4], "b")
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_table[:2]
    assert bm.allocate_slots(b, 5, hits)
    assert [bm.blocks[i].ref_count for i in hits] == [2, 2]
    assert not set(b.block_table[2:]) & set(a.block_table)  # the divergent tail is private
    assert bm.num_used_blocks == 3 + 2
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in hits] == [1, 1] and bm.num_used_blocks == 4
    bm.free(b)
    assert_pool_full(bm)
    assert bm.num_cached_blocks == 2  # still cached while free


def test_hash_is_chained_over_the_prefix():
    bm = BlockManager(16, BS)
    computed(bm, [1] * 4 + [2] * 4 + [0])
    assert bm.get_computed_blocks(make([9] * 4 + [2] * 4 + [0])) == []  # same 2nd block, other 1st
    assert len(bm.get_computed_blocks(make([1] * 4 + [3] * 4 + [0]))) == 1


def test_hit_is_capped_so_the_last_token_is_recomputed():
    bm = BlockManager(16, BS)
    computed(bm, list(range(12)))
    assert len(bm.get_computed_blocks(make(list(range(12))))) == 2  # not 3: logits need a token
    assert len(bm.get_computed_blocks(make(list(range(12)) + [7]))) == 3


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_list():
    bm = BlockManager(4, BS)
    a = computed(bm, [3] * 8 + [1])
    first_two = a.block_table[:2]
    bm.free(a)
    b = make([3] * 8 + [2])
    hits = bm.get_computed_blocks(b)
    assert hits == first_two and bm.allocate_slots(b, 1, hits)
    assert bm.num_free_blocks == 1 and [bm.blocks[i].ref_count for i in hits] == [1, 1]
    c = make([4])
    assert bm.allocate_slots(c, 1) and c.block_table[0] not in hits
    assert not bm.allocate_slots(make([5]), 1)  # the pool is used up, no block handed out twice


def test_lru_evicts_least_recently_freed_and_tail_blocks_first():
    bm = BlockManager(6, BS)
    old = computed(bm, [1] * 8 + [0], "old")  # 3 blocks, 2 cached
    new = computed(bm, [2] * 8 + [0], "new")
    old_ids, new_ids = old.block_table[:2], new.block_table[:2]
    bm.free(old)
    bm.free(new)
    # the two uncached partial blocks go first, then old's tail block, then old's head
    grab = make([9] * 12, "grab")
    assert bm.allocate_slots(grab, 12)
    assert old_ids[1] in grab.block_table and bm.num_cached_blocks == 3
    assert bm.get_computed_blocks(make([1] * 8 + [0])) == old_ids[:1]
    assert bm.get_computed_blocks(make([2] * 8 + [0])) == new_ids  # recently freed: kept
    grab2 = make([8], "grab2")
    assert bm.allocate_slots(grab2, 1) and grab2.block_table == old_ids[:1]
    assert bm.get_computed_blocks(make([1] * 8 + [0])) == []  # evicted


def test_collision_with_other_tokens_is_no_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, tokens: 42)  # everything collides
    bm = BlockManager(8, BS)
    computed(bm, [1] * 4 + [2] * 4 + [0])
    assert bm.num_cached_blocks == 1  # the 2nd block's key was taken: its chain stops
    assert bm.get_computed_blocks(make([7] * 4 + [0])) == []
    assert len(bm.get_computed_blocks(make([1] * 4 + [0]))) == 1


def test_collision_on_the_parent_is_no_hit(monkeypatch):
    # the hash ignores the parent: block tokens alone pick the entry
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, tokens: builtins.hash(tokens))
    bm = BlockManager(8, BS)
    x, y, z = [1] * 4, [2] * 4, [3] * 4
    a = computed(bm, x + y + [0], "a")
    c = computed(bm, z + [0], "c")
    hits = bm.get_computed_blocks(make(z + y + [0]))
    assert hits == c.block_table[:1]  # z hits; y is cached but was computed after x, not z
    assert bm.get_computed_blocks(make(x + y + [0])) == a.block_table[:2]


def test_same_prefix_computed_twice_keeps_the_first_copy_and_chains_on():
    bm = BlockManager(16, BS)
    x, y, z = [1] * 4, [2] * 4, [5] * 4
    a, b = make(x + y + [0], "a"), make(x + y + z + [0], "b")
    for r in (a, b):  # both admitted before either registered a block: no hits
        assert bm.allocate_slots(r, r.num_tokens)
    for r, n in ((a, 4), (b, 4), (a, 9), (b, 12)):
        r.num_computed_tokens = n
        bm.cache_full_blocks(r)
    assert bm.num_cached_blocks == 3  # a's x and y, b's z (b's x and y stay private)
    hits = bm.get_computed_blocks(make(x + y + z + [0]))
    assert hits == a.block_table[:2] + [b.block_table[2]]
    bm.free(a)
    bm.free(b)
    assert_pool_full(bm)


# -- sliding window ------------------------------------------------------------------------


def test_sliding_window_frees_the_blocks_before_the_window_and_free_skips_them():
    bm = BlockManager(16, BS)
    r = make(list(range(30)))
    assert bm.allocate_slots(r, 30)
    table = list(r.block_table)
    r.num_computed_tokens = 30  # the next token (position 30) sees positions 23..30 (window 8)
    assert bm.free_blocks_outside_window(r, 8) == 5  # blocks 0-4 hold positions 0..19
    assert bm.num_used_blocks == 3 and bm.num_window_freed(r) == 5
    assert r.block_table == table  # the entries stay: positions keep their blocks
    assert all(bm.blocks[b].ref_count == 0 for b in table[:5])
    assert bm.free_blocks_outside_window(r, 8) == 0  # nothing new
    r.num_computed_tokens = 32
    assert bm.free_blocks_outside_window(r, 8) == 1  # 25 > 24: block 5 (20..23) goes too
    bm.free(r)  # releases only the two it still holds
    assert_pool_full(bm) and bm.num_window_freed(r) == 0


def test_sliding_window_boundary_keeps_a_block_the_next_token_still_sees():
    bm = BlockManager(8, BS)
    r = make(list(range(12)))
    assert bm.allocate_slots(r, 12)
    r.num_computed_tokens = 12  # next token at 12 sees 12 - 4 < k: 9..12, block 2 (8..11)
    assert bm.free_blocks_outside_window(r, 4) == 2
    r.num_computed_tokens = 13  # sees 10..13: still block 2
    assert bm.free_blocks_outside_window(r, 4) == 0
    assert bm.free_blocks_outside_window(make([1]), 4) == 0  # a request with no blocks


def test_blocks_freed_by_the_window_stay_in_the_prefix_cache():
    bm = BlockManager(16, BS)
    a = computed(bm, list(range(20)), "a")
    assert bm.free_blocks_outside_window(a, 6) == 3
    assert bm.num_cached_blocks == 5 and bm.num_free_blocks == 14
    b = make(list(range(20)) + [99], "b")
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_table[:5]  # freed blocks still hit until evicted
    assert bm.allocate_slots(b, 1, hits)
    bm.free(a)
    bm.free(b)
    assert_pool_full(bm)


def test_allocate_each_grows_only_full_tables_and_stops_at_the_first_failure():
    bm = BlockManager(5, BS)
    room, full, late = make([1] * 5, "room"), make([1] * 4, "full"), make([1] * 4, "late")
    for r in (room, full, late):
        assert bm.allocate_slots(r, len(r.prompt_token_ids))
        r.num_computed_tokens = len(r.prompt_token_ids)
    assert bm.num_free_blocks == 1
    assert bm.allocate_each([room, full], 2)  # room: 7 tokens fit 2 blocks; full takes one
    assert [len(r.block_table) for r in (room, full)] == [2, 2] and bm.num_free_blocks == 0
    assert not bm.allocate_each([room, late, full], 1)  # late's block is short: stops there
    assert len(late.block_table) == 1
