"""The host tier with KV cache groups (radix/hybrid_manager.py): group 0's evicted blocks are written back and keep
their nodes, whose window blocks stay in group 1 until group 1 evicts them; a match reaching host-only nodes loads
group 0's blocks back and locks the resident window; a window evicted in group 1 cuts the match there. Exact ids."""

from __future__ import annotations

import pytest

from radix.block_pool import NULL_BLOCK
from radix.hybrid_manager import HybridKVCacheManager
from radix.manager import KVCacheManager
from tests.radix.radix_testing import admit

B = 4
W = 8  # a query reads keys k > q - 8: two blocks back


def cached_then_written_back() -> HybridKVCacheManager:
    """toks 1..21 (five full blocks) cached, then all of group 0's blocks written back to the host tier by a second
    request that needs the whole device pool; the second one is freed again."""
    m = HybridKVCacheManager(7, B, num_window_blocks=16, window=W, num_host_cache_blocks=8)
    admit(m, 1, list(range(1, 22)))
    m.commit_computed(1, 21)
    m.free(1)
    assert m.stats().cached_blocks == 5
    admit(m, 2, list(range(50, 74)))  # 6 blocks: every cached device block is evicted (written back)
    m.take_tier_copies()
    m.tier_copies_done()
    m.free(2)
    m.check_invariants()
    return m


def test_written_back_nodes_keep_their_window_blocks_and_load_back() -> None:
    m = cached_then_written_back()
    query = list(range(1, 22)) + [9]
    full = KVCacheManager.match_prefix(m, m.block_keys(query))
    assert (full.block_ids, len(full.host_nodes)) == ([], 5)  # group 0: all five on the host tier only
    found = m.match_prefix(m.block_keys(query))
    # group 1 still holds every node's window block (10 window blocks of seq 1 and 2's own are cached or free)
    assert found.num_tokens == 20 and len(found.host_nodes) == 5 and found.window_blocks == [4, 5]
    assert m.add_sequence(3, found) == 20
    copies = m.take_tier_copies()
    assert [h for h, _ in copies.load_back] == [n.host_block for n in found.host_nodes]
    assert m.waits_for_loads(3)
    assert m.window_block_table(3) == [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 4, 5, 13]
    m.tier_copies_done()
    assert not m.waits_for_loads(3)
    m.check_invariants()
    m.free(3)
    m.check_invariants()


def test_a_window_evicted_in_group_one_cuts_a_host_tier_hit() -> None:
    m = cached_then_written_back()
    query = list(range(1, 22)) + [9]
    group = m._window
    # release order: seq 1's blocks 0..2 at its commit, 3 and 4 at its free, then seq 2's; evict seq 1's block 3's
    order = list(group.lru)
    assert order[:5] == [1, 2, 3, 4, 5]
    group.evict(4)  # window blocks of nodes 0..3: a hit at 20 needs nodes 3, 4; at 16 nodes 2, 3; ... at 4 node 0
    found = m.match_prefix(m.block_keys(query))
    assert found.num_tokens == 0 and found.host_nodes == [] and found.window_blocks == []
    assert m.add_sequence(3, found) == 0  # nothing to load: the prefix is computed again
    assert m.take_tier_copies().load_back == []
    m.check_invariants()
    m.free(3)
    m.check_invariants()


@pytest.mark.parametrize(("num_tier", "host_only", "window_cached"), [(3, 3, 5), (2, 0, 2)])
def test_nodes_leaving_the_tree_drop_their_window_blocks(num_tier: int, host_only: int, window_cached: int) -> None:
    m = HybridKVCacheManager(7, B, num_window_blocks=32, window=W, num_host_cache_blocks=num_tier)
    admit(m, 1, list(range(1, 22)))
    m.commit_computed(1, 21)
    m.free(1)
    assert m.window_stats().cached_blocks == 5
    # 4 blocks: three cached ones are evicted; with 3 host blocks all are written back (the nodes stay, with their
    # window blocks); with 2, the third finds both pinned by their copies and leaves the tree with the two
    admit(m, 2, list(range(50, 66)))
    m.take_tier_copies()
    m.tier_copies_done()
    stats = m.stats()
    assert (stats.host_cached_blocks, stats.cached_blocks) == (host_only, 2)
    assert m.window_stats().cached_blocks == window_cached
    m.check_invariants()
    m.free(2)
    m.check_invariants()
