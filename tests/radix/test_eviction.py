"""KVCacheManager's LRU eviction and cache reset: exact eviction order (children before parents, least recently used
first), locked blocks stay, a match goes stale when blocks leave, the evicted-block count, and the events of each
(bs=4 throughout)."""

from __future__ import annotations

import pytest

from radix.events import AllBlocksCleared, BlockRemoved, BlockStored
from radix.hashing import hash_block_tokens
from radix.keys import BlockKeys
from radix.manager import KVCacheManager, StaleMatchError
from tests.radix.radix_testing import admit, finished, has_sequence, is_cached, ref_count, snapshot, toks


def test_lock_prevents_eviction_and_exact_lru_order():
    m = KVCacheManager(7, block_size=4, record_events=True)  # 6 usable
    finished(m, 1, toks(1, 8))  # blocks 1, 2
    finished(m, 2, toks(20, 27))  # blocks 3, 4
    assert m.tree.lru_order() == [2, 4]
    assert m.num_evictable_blocks() == 4
    assert admit(m, 3, toks(1, 9)) == 8  # locks 1, 2; new block 5
    assert [ref_count(m, b) for b in (1, 2, 5)] == [2, 2, 1]
    assert m.tree.lru_order() == [4]
    assert m.num_evictable_blocks() == 2
    assert m.can_allocate(3) and not m.can_allocate(4)
    assert admit(m, 4, toks(40, 51)) == 0  # 3 blocks: free 6, then evicts 4 then 3
    assert m.block_table(4) == [6, 4, 3]
    assert m.tree.lru_order() == []
    assert m.num_free_blocks() == 0
    m.check_invariants()
    events = m.drain_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved]
    assert [e.seq for e in events] == [0, 1, 2]
    assert events[2] == BlockRemoved(2, list(reversed(hash_block_tokens(toks(20, 27), 4))))


def test_parents_evicted_after_children_lru_between_chains():
    m = KVCacheManager(10, block_size=4)
    finished(m, 1, toks(1, 12))  # chain 1 <- 2 <- 3
    finished(m, 2, toks(1, 4) + toks(30, 33))  # 4 under 1 (dedup of [1..4])
    assert m.tree.lru_order() == [3, 4]
    assert admit(m, 3, toks(60, 83)) == 0  # 6 blocks: 5 free + evict 1
    m.check_invariants()
    assert m.tree.lru_order() == [2, 4]
    assert m.block_table(3) == [5, 6, 7, 8, 9, 3]
    m.commit_computed(3, 24)
    assert m.allocate(3, 8) == [2, 4]  # 2 is older than 4; then 1 becomes a leaf
    assert m.tree.lru_order() == [1]
    assert is_cached(m.tree, 1) and not is_cached(m.tree, 2)
    m.check_invariants()


def test_match_is_locked_as_taken_and_stale_after_eviction():
    m = KVCacheManager(6, block_size=4)  # 5 usable
    finished(m, 1, toks(1, 8))  # blocks 1, 2 cached, idle
    keys = m.block_keys(toks(1, 9))
    early = m.match_prefix(keys)
    assert (early.block_ids, early.num_tokens, early.keys) == ([1, 2], 8, keys) and m.is_current(early)
    assert m.add_sequence(2, early) == 8 and m.block_table(2) == [1, 2, 3]
    m.free(2)
    stale = m.match_prefix(keys)
    assert m.tree.evict(1) == [2]  # any removal bumps the epoch: the match may name a free block now
    assert not m.is_current(stale)
    before = m.stats()
    with pytest.raises(StaleMatchError):
        m.add_sequence(3, stale)
    assert m.stats() == before and not has_sequence(m, 3)
    assert m.add_sequence(3, m.match_prefix(keys)) == 4  # a fresh match
    with pytest.raises(ValueError):
        m.match_prefix(BlockKeys(toks(1, 9), 2))  # another block size
    m.check_invariants()


def test_stats_count_blocks_evicted_to_make_room():
    m = KVCacheManager(10, block_size=4)
    finished(m, 1, toks(1, 12))  # chain 1 <- 2 <- 3, evictable
    assert m.stats().evicted_blocks == 0
    assert admit(m, 2, toks(60, 83)) == 0  # 6 blocks: 6 free, nothing evicted
    assert m.stats().evicted_blocks == 0
    m.commit_computed(2, 24)
    assert m.allocate(2, 8) == [3, 2]  # 2 more blocks: the chain's leaf, then its parent
    assert m.stats().evicted_blocks == 2
    m.free(2)
    assert m.tree.clear()  # dropping the whole cache is no eviction
    assert m.stats().evicted_blocks == 2
    m.check_invariants()


def test_snapshot_events_and_reset():
    m = KVCacheManager(11, block_size=4, record_events=True)
    finished(m, 1, toks(1, 8))
    hashes = hash_block_tokens(toks(1, 8), 4)
    assert snapshot(m) == hashes
    assert m.kv_snapshot().last_seq == 0
    assert m.drain_events() == [BlockStored(0, hashes, None, 4)]
    assert admit(m, 2, toks(1, 5)) == 4
    assert not m.tree.clear()  # block 1 in use
    m.free(2)
    assert m.tree.clear()
    assert snapshot(m) == [] and m.num_free_blocks() == 10
    assert m.drain_events() == [AllBlocksCleared(1)]
    m.check_invariants()
