"""RadixTree on its own: match, insert with de-duplication, lock/unlock, exact LRU eviction order, uncache."""

from __future__ import annotations

from radix.block_pool import BlockPool
from radix.events import BlockRemoved, BlockStored, KvEventLog
from radix.hashing import block_key, hash_block_tokens
from radix.tree import InsertResult, RadixTree, TreeMatch


def toks(a: int, b: int) -> list[int]:
    return list(range(a, b + 1))


def make(num_blocks: int = 11) -> tuple[BlockPool, RadixTree, KvEventLog]:
    pool = BlockPool(num_blocks)
    events = KvEventLog()
    return pool, RadixTree(pool, 4, events=events), events


def test_insert_match_and_duplicates():
    pool, tree, events = make()
    a = pool.allocate(3)
    assert tree.insert(toks(1, 12), a) == InsertResult([1, 2, 3], [])
    assert [pool.ref_count(b) for b in a] == [2, 2, 2]
    b = pool.allocate(2)  # [4, 5]: [1..4] then [20..23]
    assert tree.insert(toks(1, 4) + toks(20, 23), b) == InsertResult([1, 5], [4])
    assert pool.ref_count(4) == 1 and pool.ref_count(5) == 2
    hashes = hash_block_tokens(toks(1, 12), 4)
    assert tree.match(toks(1, 14)) == TreeMatch([1, 2, 3], hashes)
    assert tree.match(toks(1, 14), max_blocks=2) == TreeMatch([1, 2], hashes[:2])
    assert tree.match(toks(1, 4) + toks(20, 23)).block_ids == [1, 5]
    assert tree.match(toks(2, 9)).block_ids == []
    assert tree.match(toks(1, 12), extra_keys=("salt",)).block_ids == []
    assert tree.match_hashes(hashes) == [1, 2, 3]
    assert tree.match_hashes(hashes[1:]) == []  # not a chain from the root
    assert tree.num_cached == 4 and tree.num_evictable == 0
    assert [type(e) for e in events.drain()] == [BlockStored, BlockStored]
    tree.check_invariants()


def test_unlock_makes_leaves_evictable_and_evict_follows_lru():
    pool, tree, events = make()
    a = pool.allocate(3)
    tree.insert(toks(1, 12), a)  # 1 <- 2 <- 3
    b = pool.allocate(1)
    side = hash_block_tokens(toks(1, 4) + toks(30, 33), 4)
    assert tree.insert_chain(side[0], side[1:], [block_key(toks(30, 33))], b) == InsertResult([4], [])
    assert tree.num_cached == 4
    tree.unlock(b)  # 4 released first: least recently used
    tree.unlock(a)
    assert tree.num_evictable == 4
    assert tree.lru_order() == [4, 3]
    events.drain()
    assert tree.evict(2) == [4, 3]
    assert tree.lru_order() == [2]
    assert tree.evict(5) == [2, 1]
    assert pool.free_block_ids()[-4:] == [4, 3, 2, 1]
    removed = events.drain()
    chain = hash_block_tokens(toks(1, 12), 4)
    assert removed == [BlockRemoved(2, [side[1], chain[2]]), BlockRemoved(3, [chain[1], chain[0]])]
    assert tree.num_cached == 0 and tree.num_evictable == 0
    tree.check_invariants()
    pool.check_invariants()


def test_lock_takes_block_out_of_lru():
    pool, tree, _ = make()
    a = pool.allocate(2)
    tree.insert(toks(1, 8), a)
    tree.unlock(a)
    assert tree.lru_order() == [2]
    tree.lock([1, 2])
    assert tree.lru_order() == [] and tree.num_evictable == 0
    assert tree.evict(1) == []
    tree.unlock([2])
    assert tree.lru_order() == [2] and tree.num_evictable == 1
    tree.check_invariants()


def test_uncache_stops_at_non_leaf():
    pool, tree, events = make()
    a = pool.allocate(3)
    tree.insert(toks(1, 12), a)
    assert tree.uncache([2]) == 0  # has a child
    assert tree.uncache([3, 2]) == 2
    assert [pool.ref_count(b) for b in a] == [2, 1, 1]  # the caller still holds them
    assert tree.num_cached == 1
    tree.check_invariants()


def test_collision_is_detected_by_stored_key():
    pool = BlockPool(11)
    tree = RadixTree(pool, 4, hash_fn=lambda data: b"\x00")  # every block collides
    a = pool.allocate(2)
    assert tree.insert(toks(1, 8), a).resident == [1]  # block 2's hash collides with block 1's
    assert tree.match(toks(1, 8)).block_ids == [1]
    assert tree.match(toks(5, 12)).block_ids == []
    b = pool.allocate(1)
    assert tree.insert(toks(50, 53), b) == InsertResult([], [])
    tree.check_invariants()


def test_clear_only_when_all_evictable():
    pool, tree, events = make()
    a = pool.allocate(2)
    tree.insert(toks(1, 8), a)
    assert not tree.clear()
    tree.unlock(a)
    assert tree.clear()
    assert pool.num_free == 10 and tree.num_cached == 0
    tree.check_invariants()
