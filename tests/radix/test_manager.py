"""Unit tests of KVCacheManager: exact block ids, ref counts, free counts and eviction order (bs=4 throughout)."""

from __future__ import annotations

import pytest

from radix.block_pool import NoFreeBlocksError
from radix.events import AllBlocksCleared, BlockRemoved, BlockStored
from radix.hashing import blake2b_128, hash_block_tokens
from radix.keys import BlockKeys
from radix.manager import KVCacheManager, KVStats, StaleMatchError, UnknownSequenceError
from tests.radix.radix_testing import (
    admit,
    cache_computed_blocks,
    has_sequence,
    is_cached,
    is_swapped,
    match,
    num_tokens,
    ref_count,
    slot_mapping,
    snapshot,
)


def toks(a: int, b: int) -> list[int]:
    return list(range(a, b + 1))


def finished(m: KVCacheManager, seq_id: int, tokens: list[int]) -> None:
    """Admit, compute everything, free: the tokens end up cached."""
    assert admit(m, seq_id, tokens) is not None
    m.commit_computed(seq_id, len(tokens))
    m.free(seq_id)
    m.check_invariants()


def test_add_sequence_allocates_from_the_free_queue():
    m = KVCacheManager(11, block_size=4)
    assert m.num_blocks == 11 and m.block_size == 4
    assert admit(m, 1, toks(1, 10)) == 0
    assert m.block_table(1) == [1, 2, 3]
    assert [ref_count(m, b) for b in (1, 2, 3)] == [1, 1, 1]
    assert m.num_computed_tokens(1) == 0
    assert num_tokens(m, 1) == 10
    assert m.num_free_blocks() == 7
    assert has_sequence(m, 1) and not has_sequence(m, 2)
    m.check_invariants()


def test_add_sequence_chunk_and_allocate_rest():
    m = KVCacheManager(11, block_size=4)
    assert admit(m, 1, toks(1, 10), num_new_tokens=4) == 0
    assert m.block_table(1) == [1]
    m.commit_computed(1, 4)
    assert m.allocate(1, 4) == [2]
    assert m.allocate(1, 4) == []  # already covered
    m.commit_computed(1, 8)
    assert m.allocate(1, 2) == [3]
    m.commit_computed(1, 10)
    assert m.stats().cached_blocks == 2
    m.check_invariants()


def test_add_sequence_without_room_has_no_side_effect():
    m = KVCacheManager(4, block_size=4)  # 3 usable blocks
    finished(m, 1, toks(1, 8))  # 2 cached, evictable
    before = m.stats()
    assert admit(m, 2, toks(100, 116)) is None  # needs 5 blocks
    assert m.stats() == before
    assert not has_sequence(m, 2)
    assert m.tree.lru_order() == [2]
    # the cached prefix counts only once: [1..8] + 12 new tokens needs 5 blocks (2 locked + 3 new) > 3 usable
    assert admit(m, 3, toks(1, 8) + toks(50, 61)) is None
    assert m.stats() == before


def test_prefix_match_caps_and_counts_stats():
    m = KVCacheManager(11, block_size=4)
    finished(m, 1, toks(1, 8))
    assert match(m, toks(1, 8)) == ([1], 4)
    assert match(m, toks(1, 9)) == ([1, 2], 8)
    assert match(m, toks(1, 3)) == ([], 0)
    assert match(m, []) == ([], 0)
    assert admit(m, 2, toks(1, 9)) == 8
    assert m.num_computed_tokens(2) == 8
    assert m.block_table(2) == [1, 2, 3]
    assert admit(m, 3, toks(1, 9), count_stats=False) == 8
    stats = m.stats()
    assert (stats.prefix_queries_tokens, stats.prefix_hits_tokens) == (8 + 9, 8)
    assert stats.hit_rate == 8 / 17


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


def test_allocate_none_without_side_effect():
    m = KVCacheManager(4, block_size=4)
    assert admit(m, 1, toks(1, 4)) == 0
    m.commit_computed(1, 4)
    before = (m.block_table(1), m.num_free_blocks())
    assert m.allocate(1, 13) is None
    assert (m.block_table(1), m.num_free_blocks()) == before
    assert m.allocate(1, 8) == [2, 3]
    with pytest.raises(ValueError):
        m.allocate(1, -1)


def test_decode_append_commit_and_slot_mapping():
    m = KVCacheManager(11, block_size=4)
    assert admit(m, 1, toks(1, 6)) == 0
    m.commit_computed(1, 6)
    m.append_tokens(1, [7])
    assert num_tokens(m, 1) == 7
    assert m.allocate(1, 1) == []
    m.commit_computed(1, 7)
    m.append_tokens(1, [8])
    m.commit_computed(1, 8)
    assert m.stats().cached_blocks == 2
    m.append_tokens(1, [9])
    assert m.allocate(1, 1) == [3]
    assert slot_mapping(m, 1, 6, 9) == [2 * 4 + 2, 2 * 4 + 3, 3 * 4 + 0]
    assert slot_mapping(m, 1, 0, 0) == []
    with pytest.raises(ValueError):
        m.commit_computed(1, 10)  # past the known tokens
    with pytest.raises(ValueError):
        m.commit_computed(1, 7)  # backwards


def test_fork_and_copy_on_write():
    m = KVCacheManager(11, block_size=4)
    assert admit(m, 1, toks(1, 6)) == 0
    m.commit_computed(1, 6)
    m.fork(1, 2)
    assert m.block_table(2) == [1, 2]
    assert [ref_count(m, b) for b in (1, 2)] == [3, 2]  # block 1: two tables + tree
    assert num_tokens(m, 2) == 6 and m.num_computed_tokens(2) == 6
    m.append_tokens(1, [7])
    m.append_tokens(2, [70])
    assert m.prepare_write(1, 6, 7) == [(2, 3)]
    assert m.block_table(1) == [1, 3]
    assert ref_count(m, 2) == 1
    assert m.prepare_write(2, 6, 7) == []  # block 2 is now private to seq 2
    m.check_invariants()
    with pytest.raises(ValueError):
        m.prepare_write(2, 2, 3)  # inside the cached prefix
    with pytest.raises(ValueError):
        m.fork(1, 2)


def test_prepare_write_without_room_raises_and_changes_nothing():
    m = KVCacheManager(3, block_size=4)  # 2 usable
    assert admit(m, 1, toks(1, 2)) == 0
    m.commit_computed(1, 2)
    m.fork(1, 2)
    m.fork(1, 3)
    assert m.prepare_write(1, 2, 3) == [(1, 2)]
    with pytest.raises(NoFreeBlocksError):
        m.prepare_write(2, 2, 3)
    assert m.block_table(2) == [1] and ref_count(m, 1) == 2
    m.check_invariants()


def test_cache_computed_blocks_is_idempotent_and_bounded():
    m = KVCacheManager(11, block_size=4)
    assert admit(m, 1, toks(1, 10)) == 0
    m.commit_computed(1, 9)
    assert m.stats().cached_blocks == 2
    refs = [ref_count(m, b) for b in m.block_table(1)]
    assert refs == [2, 2, 1]
    cache_computed_blocks(m, 1, 9)
    assert m.stats().cached_blocks == 2 and [ref_count(m, b) for b in m.block_table(1)] == refs
    assert m.num_computed_tokens(1) == 9
    with pytest.raises(ValueError):
        cache_computed_blocks(m, 1, 10)
    m.check_invariants()


def test_free_releases_and_caches_only_full_computed_blocks():
    m = KVCacheManager(11, block_size=4)
    assert admit(m, 1, toks(1, 10)) == 0
    m.commit_computed(1, 6)  # 1 full block written
    assert m.stats().cached_blocks == 1
    m.free(1)
    assert m.stats().cached_blocks == 1  # block 2 was not fully written
    assert m.num_free_blocks() == 9
    assert m.num_evictable_blocks() == 1
    with pytest.raises(UnknownSequenceError):
        m.free(1)
    with pytest.raises(KeyError):
        m.block_table(1)
    m.check_invariants()


def test_free_keep_tokens_uncaches_blocks_past_a_stop_string():
    m = KVCacheManager(11, block_size=4, record_events=True)
    assert admit(m, 1, toks(1, 5)) == 0
    m.commit_computed(1, 5)
    m.append_tokens(1, toks(6, 13))
    m.allocate(1, 8)
    m.commit_computed(1, 13)
    assert m.stats().cached_blocks == 3
    m.drain_events()
    m.free(1, keep_tokens=6)
    assert snapshot(m) == hash_block_tokens(toks(1, 4), 4)
    assert m.num_free_blocks() == 9
    assert m.drain_events() == [BlockRemoved(2, hash_block_tokens(toks(1, 12), 4)[:0:-1])]
    m.check_invariants()


def test_swap_out_and_in():
    m = KVCacheManager(7, block_size=4, num_host_blocks=3)
    assert admit(m, 1, toks(1, 10)) == 0
    m.commit_computed(1, 10)
    assert m.swap_out(1) == [(1, 0), (2, 1), (3, 2)]
    assert is_swapped(m, 1) and m.block_table(1) == []
    assert m.num_free_blocks() == 4 and m.num_evictable_blocks() == 2
    assert m.stats().host_free_blocks == 0 and m.stats().num_swapped == 1
    with pytest.raises(ValueError):
        m.allocate(1, 1)
    assert admit(m, 2, toks(50, 65)) == 0  # 4 blocks
    assert m.swap_in(1) is None  # 2 evictable < 3
    assert is_swapped(m, 1)
    m.free(2)
    assert m.swap_in(1) == [(0, 4), (1, 5), (2, 6)]
    assert m.block_table(1) == [4, 5, 6] and m.num_computed_tokens(1) == 10
    m.check_invariants()
    m.append_tokens(1, [11])
    m.commit_computed(1, 11)  # re-inserts: blocks 1, 2 were idle resident duplicates: 4, 5 replace them, they go
    assert [ref_count(m, b) for b in (1, 2, 4, 5)] == [0, 0, 2, 2]
    m.free(1)
    assert m.num_free_blocks() == 4 and m.num_evictable_blocks() == 2 and m.stats().host_free_blocks == 3
    m.check_invariants()


def test_swap_out_without_host_room_returns_none():
    m = KVCacheManager(7, block_size=4)
    assert admit(m, 1, toks(1, 4)) == 0
    assert m.swap_out(1) is None
    assert m.block_table(1) == [1]
    with pytest.raises(ValueError):
        m.swap_in(1)


def test_stats_waste_and_totals():
    m = KVCacheManager(11, block_size=4)
    assert admit(m, 1, toks(1, 5)) == 0
    assert admit(m, 2, toks(1, 3), num_new_tokens=9) == 0
    stats = m.stats()
    assert stats == KVStats(
        total_blocks=10,
        free_blocks=5,
        evictable_blocks=0,
        in_use_blocks=5,
        cached_blocks=0,
        prefix_queries_tokens=8,
        prefix_hits_tokens=0,
        waste_slots=3 + 9,
        num_sequences=2,
        num_swapped=0,
        host_total_blocks=0,
        host_free_blocks=0,
    )


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


def test_prefix_caching_disabled():
    m = KVCacheManager(11, block_size=4, enable_prefix_caching=False, record_events=True)
    finished(m, 1, toks(1, 8))
    assert match(m, toks(1, 9)) == ([], 0)
    assert admit(m, 2, toks(1, 9)) == 0
    assert m.stats().cached_blocks == 0 and m.num_free_blocks() == 7
    assert m.drain_events() == [] and snapshot(m) == []


def test_errors():
    m = KVCacheManager(5, block_size=4)
    with pytest.raises(UnknownSequenceError):
        m.allocate(9, 1)
    with pytest.raises(UnknownSequenceError):
        m.fork(9, 10)
    with pytest.raises(ValueError):
        admit(m, 1, [])
    assert admit(m, 1, [1]) == 0
    with pytest.raises(ValueError):
        admit(m, 1, [1])
    with pytest.raises(ValueError):
        m.free(1, keep_tokens=-1)
    with pytest.raises(ValueError):
        KVCacheManager(1)
    with pytest.raises(ValueError):
        KVCacheManager(4, block_size=0)


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


def test_each_block_is_hashed_once_and_a_match_hashes_nothing():
    calls: list[bytes] = []

    def counting(data: bytes) -> bytes:
        calls.append(data)
        return blake2b_128(data)

    m = KVCacheManager(21, block_size=4, hash_fn=counting)
    prompt = toks(1, 14)
    keys = m.block_keys(prompt)
    assert calls == []
    assert m.add_sequence(1, m.match_prefix(keys)) == 0
    assert calls == []  # matching and admitting hash nothing
    m.commit_computed(1, 6)
    m.commit_computed(1, 14)
    m.append_tokens(1, [15, 16])
    assert m.allocate(1, 2) == []
    m.commit_computed(1, 16)
    m.free(1)
    assert len(calls) == 4  # blocks [1..4], [5..8], [9..12], [13..16]: once each
    assert snapshot(m) == hash_block_tokens(toks(1, 16), 4)
    for seq_id in (2, 3):  # a full hit, then commits and frees of blocks already in the tree: no hashing
        assert m.add_sequence(seq_id, m.match_prefix(m.block_keys(toks(1, 17)))) == 16
        m.commit_computed(seq_id, 17)
        m.free(seq_id)
    assert len(calls) == 4
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
