"""Preemption by swap with KV cache groups (radix/hybrid_manager.py, radix/swa_group.py): group 1's live window
blocks go to its own host pool and come back, NULL entries stay NULL, exact pairs, all or nothing, nothing leaked."""

from __future__ import annotations

from radix.block_pool import NULL_BLOCK
from radix.hybrid_manager import HybridKVCacheManager, WindowSwaps
from tests.radix.radix_testing import admit

B = 4
W = 8  # a query reads keys k > q - 8: two blocks back


def hybrid(num_blocks: int = 32, num_window_blocks: int = 16, num_host_blocks: int = 8) -> HybridKVCacheManager:
    return HybridKVCacheManager(
        num_blocks, B, num_window_blocks=num_window_blocks, window=W, num_host_blocks=num_host_blocks
    )


def test_swap_out_and_in_moves_the_live_window_blocks_only() -> None:
    m = hybrid()
    admit(m, 1, list(range(1, 19)))  # 18 tokens: five blocks
    m.commit_computed(1, 18)  # first_live(18) = 2: window entries 0, 1 released (cached on their nodes)
    assert m.window_block_table(1) == [NULL_BLOCK, NULL_BLOCK, 3, 4, 5]
    assert m.swap_out(1) == [(1, 0), (2, 1), (3, 2), (4, 3), (5, 4)]
    assert m.take_window_swaps() == WindowSwaps([(3, 0), (4, 1), (5, 2)], [])
    assert m.take_window_swaps() == WindowSwaps([], [])
    stats = m.window_stats()
    # 3, 4 are cached on nodes (now evictable), 5 (the partial block) is free again
    assert (stats.in_use_blocks, stats.evictable_blocks, stats.cached_blocks) == (0, 4, 4)
    assert m._window.host_pool.num_free == 5
    assert m.block_table(1) == m.window_block_table(1) == []  # swapped out: no device block in either group
    m.check_invariants()
    assert m.swap_in(1) is not None
    swaps = m.take_window_swaps()
    assert swaps.swap_out == [] and [h for h, _ in swaps.swap_in] == [0, 1, 2]
    table = m.window_block_table(1)
    assert table[:2] == [NULL_BLOCK, NULL_BLOCK] and table[2:] == [d for _, d in swaps.swap_in]
    assert m._window.host_pool.num_free == 8
    m.check_invariants()
    m.commit_computed(1, 18)  # the full blocks re-enter the tree; their nodes keep the window blocks they had
    m.check_invariants()
    m.free(1)
    m.check_invariants()
    assert m.window_stats().in_use_blocks == 0


def test_swap_out_is_refused_whole_when_a_host_pool_lacks_room() -> None:
    m = hybrid(num_host_blocks=2)
    admit(m, 1, list(range(1, 11)))  # three blocks in each group: the host pools hold two
    m.commit_computed(1, 10)
    before = (m.block_table(1), m.window_block_table(1), m.window_stats())
    assert m.swap_out(1) is None
    assert (m.block_table(1), m.window_block_table(1), m.window_stats()) == before
    assert m.take_window_swaps() == WindowSwaps([], [])
    m.check_invariants()
    m.free(1)
    m.check_invariants()


def test_swap_in_waits_for_window_room_without_side_effects() -> None:
    m = hybrid(num_window_blocks=6)  # 5 usable window blocks
    admit(m, 1, list(range(1, 13)))  # 12 tokens, three blocks; first_live(12) = 1
    m.commit_computed(1, 12)
    m.swap_out(1)
    m.take_window_swaps()
    admit(m, 2, list(range(50, 62)), num_new_tokens=11)  # three window blocks for 11 tokens (+ evictions)
    m.commit_computed(2, 11)
    m.append_tokens(2, [])
    assert m.allocate(2, 1) == []
    # group 1 now has 5 - 3 in use = 2 blocks to give (free or evictable), seq 1 needs 2 for entries 1, 2
    assert m.window_stats().in_use_blocks == 3
    m.allocate(2, 9)  # two more entries in both groups: no window room left for seq 1
    assert m.swap_in(1) is None
    assert m.take_window_swaps() == WindowSwaps([], [])
    m.check_invariants()
    m.free(2)
    assert m.swap_in(1) is not None
    assert len(m.take_window_swaps().swap_in) == 2
    m.check_invariants()
    m.free(1)
    m.check_invariants()


def test_free_while_swapped_returns_both_host_pools() -> None:
    m = hybrid()
    admit(m, 1, list(range(1, 8)))
    m.commit_computed(1, 7)
    assert m.swap_out(1) is not None
    m.free(1)
    assert m._window.host_pool.num_free == 8 and m.stats().num_sequences == 0
    m.check_invariants()
