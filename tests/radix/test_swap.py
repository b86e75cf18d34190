"""KVCacheManager's swap preemption: a sequence's blocks move to the host swap pool and back (bs=4 throughout)."""

from __future__ import annotations

import pytest

from radix.manager import KVCacheManager
from tests.radix.radix_testing import admit, is_swapped, ref_count, toks


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
