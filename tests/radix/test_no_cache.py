"""A KVCacheManager without prefix caching (radix/no_cache.py): nothing is matched, cached, evicted or reported, its
keys have no chain ids, and block tables behave exactly as with caching (bs=4 throughout)."""

from __future__ import annotations

from radix.manager import KVCacheManager
from tests.radix.radix_testing import admit, finished, match, ref_count, snapshot, toks


def test_prefix_caching_disabled():
    m = KVCacheManager(11, block_size=4, enable_prefix_caching=False, record_events=True)
    finished(m, 1, toks(1, 8))
    assert match(m, toks(1, 9)) == ([], 0)
    assert admit(m, 2, toks(1, 9)) == 0
    assert m.stats().cached_blocks == 0 and m.num_free_blocks() == 7
    assert m.drain_events() == [] and snapshot(m) == []


def test_keys_have_no_chain_ids():
    off = KVCacheManager(11, block_size=4, enable_prefix_caching=False)
    keys = off.block_keys(toks(1, 9))
    assert len(keys) == 2 and keys.chain_ids == [] and keys.extended(toks(1, 13)).chain_ids == []
    on = KVCacheManager(11, block_size=4)
    assert len(on.block_keys(toks(1, 9)).chain_ids) == 2 and len(on.block_keys(toks(1, 9)).extended(toks(1, 13))) == 3


def test_tables_fork_copy_on_write_and_free_queue_order():
    m = KVCacheManager(11, block_size=4, enable_prefix_caching=False)
    keys = m.block_keys(toks(1, 6))
    taken = m.match_prefix(keys)
    assert (taken.block_ids, taken.num_tokens, taken.last_node, taken.host_nodes) == ([], 0, None, [])
    assert m.add_sequence(1, taken) == 0 and m.block_table(1) == [1, 2]
    m.commit_computed(1, 6)
    m.fork(1, 2)
    assert [ref_count(m, b) for b in (1, 2)] == [2, 2]  # two tables, no cache reference
    m.append_tokens(1, [7])
    assert m.prepare_write(1, 6, 7) == [(2, 3)] and m.block_table(1) == [1, 3] and ref_count(m, 2) == 1
    m.free(1)
    m.free(2)
    assert m._pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 10, 3, 1, 2]  # everything back, in release order
    assert m.is_current(taken) and m.tree.evict(3) == [] and m.num_evictable_blocks() == 0
    assert admit(m, 3, toks(1, 9)) == 0 and m.block_table(3) == [4, 5, 6]
    stats = m.stats()
    assert (stats.prefix_queries_tokens, stats.prefix_hits_tokens, stats.hit_rate) == (6 + 9, 0, 0.0)
    assert (stats.cached_blocks, stats.evictable_blocks, stats.evicted_blocks) == (0, 0, 0)
    assert m.kv_snapshot().last_seq == -1
    m.check_invariants()
