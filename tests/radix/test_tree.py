"""RadixTree on its own: match by tokens, insert with de-duplication, lock/unlock, exact LRU eviction order, uncache."""

from __future__ import annotations

from radix.block_pool import BlockPool
from radix.events import BlockRemoved, BlockStored, KvEventLog
from radix.hashing import hash_block_tokens
from radix.keys import pack_blocks
from radix.tree import RadixTree
from tests.radix.radix_testing import toks, tree_insert, tree_match


def ins(tree: RadixTree, tokens: list[int], blocks: list[int]) -> tuple[list[int], list[int]]:
    found = tree_insert(tree, tokens, blocks)
    return found.resident, found.duplicates


def make(num_blocks: int = 11) -> tuple[BlockPool, RadixTree, KvEventLog]:
    pool = BlockPool(num_blocks)
    events = KvEventLog()
    return pool, RadixTree(pool, 4, events=events), events


def test_insert_match_and_duplicates():
    pool, tree, events = make()
    a = pool.allocate(3)
    assert ins(tree, toks(1, 12), a) == ([1, 2, 3], [])
    assert [pool.ref_count(b) for b in a] == [2, 2, 2]
    b = pool.allocate(2)  # [4, 5]: [1..4] then [20..23]
    assert ins(tree, toks(1, 4) + toks(20, 23), b) == ([1, 5], [4])
    assert pool.ref_count(4) == 1 and pool.ref_count(5) == 2
    hashes = hash_block_tokens(toks(1, 12), 4)
    assert tree_match(tree, toks(1, 14)) == [1, 2, 3]
    assert [tree.block_hash(b) for b in (1, 2, 3)] == hashes  # the hash each block got when it was inserted
    assert tree.block_hash(5) == hash_block_tokens(toks(1, 4) + toks(20, 23), 4)[1]
    assert tree_match(tree, toks(1, 14), max_blocks=2) == [1, 2]
    found = tree.match(pack_blocks(toks(1, 14), 4), None, 3)
    assert found.block_ids == [1, 2, 3] and found.last_node is not None and found.last_node.block_id == 3
    assert tree.match(pack_blocks(toks(2, 9), 4), None, 2) == ([], None, [])
    assert tree_match(tree, toks(1, 4) + toks(20, 23)) == [1, 5]
    assert tree_match(tree, toks(2, 9)) == []
    assert tree_match(tree, toks(1, 12), salt="salt") == []
    assert tree.num_cached == 4 and tree.num_evictable == 0
    assert [type(e) for e in events.drain()] == [BlockStored, BlockStored]
    tree.check_invariants()


def test_unlock_makes_leaves_evictable_and_evict_follows_lru():
    pool, tree, events = make()
    a = pool.allocate(3)
    tree_insert(tree, toks(1, 12), a)  # 1 <- 2 <- 3
    b = pool.allocate(1)
    side = hash_block_tokens(toks(1, 4) + toks(30, 33), 4)
    under = tree.match(pack_blocks(toks(1, 4), 4), None, 1).last_node  # block 1's node
    found = tree.insert_chain(under, None, pack_blocks(toks(30, 33), 4), b)
    assert (found.resident, found.duplicates) == ([4], []) and found.last_node is not None
    assert tree.block_hash(4) == side[1]
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
    tree_insert(tree, toks(1, 8), a)
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
    tree_insert(tree, toks(1, 12), a)
    epoch = tree.epoch
    assert tree.uncache([2]) == 0  # has a child
    assert tree.epoch == epoch  # nothing removed: matches stay valid
    assert tree.uncache([3, 2]) == 2
    assert tree.epoch == epoch + 1
    assert [pool.ref_count(b) for b in a] == [2, 1, 1]  # the caller still holds them
    assert tree.num_cached == 1
    tree.check_invariants()


def test_collision_is_not_cached():
    pool = BlockPool(11)
    tree = RadixTree(pool, 4, hash_fn=lambda data: b"\x00")  # every block collides
    a = pool.allocate(2)
    assert tree_insert(tree, toks(1, 8), a).resident == [1]  # block 2's hash collides with block 1's: not cached
    assert tree_match(tree, toks(1, 8)) == [1]
    assert tree_match(tree, toks(5, 12)) == []
    b = pool.allocate(1)
    assert ins(tree, toks(50, 53), b) == ([], [])
    tree.check_invariants()


def test_clear_only_when_all_evictable():
    pool, tree, events = make()
    a = pool.allocate(2)
    tree_insert(tree, toks(1, 8), a)
    assert not tree.clear()
    tree.unlock(a)
    assert tree.clear()
    assert pool.num_free == 10 and tree.num_cached == 0
    tree.check_invariants()


def test_each_salt_has_its_own_subtree_and_an_empty_one_goes():
    pool, tree, events = make()
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert ins(tree, toks(1, 8), a) == ([1, 2], [])
    assert tree_insert(tree, toks(1, 8), b, salt="s").resident == [3, 4]  # same tokens, other tenant: no sharing
    assert tree_match(tree, toks(1, 9), salt="s") == [3, 4] and tree_match(tree, toks(1, 9)) == [1, 2]
    assert [tree.block_hash(x) for x in b] == hash_block_tokens(toks(1, 8), 4, cache_salt="s")
    tree.unlock(b)
    assert tree.evict(2) == [4, 3]
    assert list(tree._nodes.roots) == [None]  # the salt's empty root went with its last block
    tree.check_invariants()
    assert tree_insert(tree, toks(1, 8), pool.allocate(1), salt="s").resident == [5]
    tree.check_invariants()
