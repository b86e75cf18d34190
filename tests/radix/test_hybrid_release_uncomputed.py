"""HybridKVCacheManager.release_uncomputed, speculative decoding's rollback with KV cache groups: the sliding-window
group's table is cut to the same length as group 0's (aligned tables), its cut blocks go back to its pool, the
window blocks before the computed tokens' window stay cached, and every invariant holds."""

from __future__ import annotations

from radix.block_pool import NULL_BLOCK
from radix.hybrid_manager import HybridKVCacheManager, WindowGroupStats
from tests.radix.radix_testing import admit, toks

B = 4
W = 8  # a query reads keys k > q - 8: two blocks back


def test_rollback_cuts_both_groups_alike() -> None:
    m = HybridKVCacheManager(16, B, num_window_blocks=16, window=W)
    assert admit(m, 1, toks(1, 10)) == 0
    m.commit_computed(1, 10)
    m.append_tokens(1, [50])  # 11 known tokens, 10 computed
    assert m.allocate(1, 1 + 6) == [4, 5]  # the last token and a 6-token draft: positions 10..16
    assert m.window_block_table(1) == [1, 2, 3, 4, 5]
    m.prepare_write(1, 10, 17)
    m.append_tokens(1, [51, 52])  # two draft tokens accepted, then a third drawn
    m.commit_computed(1, 13)  # first_live(13) = 1: window block 1 released, cached with its node
    m.check_invariants()
    assert m.release_uncomputed(1) == [5]  # block 5 held only rejected slots (16)
    assert m.block_table(1) == [1, 2, 3, 4]
    assert m.window_block_table(1) == [NULL_BLOCK, 2, 3, 4]
    # window group: 15 usable; 3 in use (2, 3, 4), 1 evictable (1), block 5 free again; 3 nodes hold 1, 2, 3
    assert m.window_stats() == WindowGroupStats(15, 11, 1, 3, 3, 0)
    m.check_invariants()
    assert m.release_uncomputed(1) == []  # nothing past cdiv(13, 4) = 4 blocks: both tables unchanged
    assert m.window_block_table(1) == [NULL_BLOCK, 2, 3, 4]
    # the next decode takes a block in each group at the same index again
    m.append_tokens(1, [53, 54, 55])
    assert m.allocate(1, 4) == [6]  # the free queue is FIFO: block 5 went to its end
    assert m.window_block_table(1) == [NULL_BLOCK, 2, 3, 4, 6]
    m.free(1)
    m.check_invariants()
    window = m.window_stats()
    assert window.in_use_blocks == 0 and window.free_blocks + window.evictable_blocks == 15
