"""Unit tests of KVCacheManager's block tables: admission, growth, copy-on-write, commit and free, with exact block
ids, ref counts and free counts (bs=4 throughout). Eviction is tests/radix/test_eviction.py, swapping
tests/radix/test_swap.py, the manager without prefix caching tests/radix/test_no_cache.py."""

from __future__ import annotations

import pytest

from radix.block_pool import NoFreeBlocksError
from radix.events import BlockRemoved
from radix.hashing import blake2b_128, hash_block_tokens
from radix.manager import KVCacheManager, KVStats, UnknownSequenceError
from tests.radix.radix_testing import (
    admit,
    cache_computed_blocks,
    finished,
    has_sequence,
    match,
    num_tokens,
    ref_count,
    slot_mapping,
    snapshot,
    toks,
)


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
