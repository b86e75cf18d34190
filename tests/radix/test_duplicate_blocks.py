"""A sequence writes a block the tree already holds (the cache hit stops one block short, or a swapped-in sequence
commits again): an idle resident copy is replaced by the sequence's and freed; a copy in use stays and the sequence
references it too (its shadow). Exact block ids, ref counts, free queue and events (bs=4)."""

from __future__ import annotations

from radix.manager import KVCacheManager
from tests.radix.radix_testing import admit, match, ref_count, toks


def test_an_idle_resident_duplicate_is_replaced_and_freed_one_in_use_is_shared():
    m = KVCacheManager(6, block_size=4, record_events=True)  # 5 usable blocks
    assert admit(m, 1, toks(1, 8)) == 0  # blocks 1, 2
    m.commit_computed(1, 8)
    m.free(1)
    events = m.drain_events()
    assert [ref_count(m, b) for b in (1, 2)] == [1, 1] and m._pool.free_block_ids() == [3, 4, 5]
    assert admit(m, 2, toks(1, 8)) == 4  # the hit stops before the last token: block 2's tokens are written again
    assert m.block_table(2) == [1, 3]
    stale = m.match_prefix(m.block_keys(toks(1, 9)))
    assert stale.block_ids == [1, 2]
    m.commit_computed(2, 8)
    assert m.tree.block_hash(3) is not None and m.tree.block_hash(2) is None  # the tree holds block 3 now
    assert [ref_count(m, b) for b in (1, 2, 3)] == [2, 0, 2] and m._seqs[2].shadow == []
    assert m._pool.free_block_ids() == [4, 5, 2] and m.num_evictable_blocks() == 0
    assert not m.is_current(stale) and match(m, toks(1, 9)) == ([1, 3], 8)
    assert m.drain_events() == []  # the same hashes stay resident: nothing for a router to learn
    assert m.kv_snapshot().block_hashes == [e for ev in events for e in ev.block_hashes]
    m.check_invariants()
    m.free(2)
    assert (m.num_free_blocks(), m.num_evictable_blocks(), m.stats().cached_blocks) == (3, 2, 2)
    m.check_invariants()

    m = KVCacheManager(6, block_size=4)  # the same, but the resident copy is in use by another sequence
    assert admit(m, 1, toks(1, 8)) == 0
    m.commit_computed(1, 8)  # seq 1 still runs: blocks 1, 2 in use
    assert admit(m, 2, toks(1, 8)) == 4 and m.block_table(2) == [1, 3]
    m.commit_computed(2, 8)
    assert m.tree.block_hash(2) is not None and m.tree.block_hash(3) is None
    assert [ref_count(m, b) for b in (1, 2, 3)] == [3, 3, 1] and m._seqs[2].shadow == [2]
    m.check_invariants()
    m.free(1)
    m.free(2)
    assert (m.num_free_blocks(), m.num_evictable_blocks(), m.stats().cached_blocks) == (3, 2, 2)
    m.check_invariants()
