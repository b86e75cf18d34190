from __future__ import annotations

import pytest

from radix.block_pool import BlockPool, NoFreeBlocksError


def test_null_block_reserved_and_fifo_order():
    pool = BlockPool(5)
    assert pool.num_usable == 4
    assert pool.num_free == 4
    assert pool.allocate(2) == [1, 2]
    assert pool.ref_counts[1:3] == [1, 1]
    assert pool.num_free == 2
    assert pool.decref(1) == 0
    assert pool.free_block_ids() == [3, 4, 1]
    assert pool.allocate(3) == [3, 4, 1]
    assert pool.num_free == 0
    pool.check_invariants()


def test_no_free_blocks_is_typed_and_side_effect_free():
    pool = BlockPool(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.num_free == 2
    assert issubclass(NoFreeBlocksError, RuntimeError)
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_incref_decref_exact_counts():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    assert pool.incref(b) == 2
    assert pool.incref(b) == 3
    assert pool.decref(b) == 2
    assert pool.ref_count(b) == 2
    assert pool.num_free == 2
    assert pool.decref(b) == 1
    assert pool.decref(b) == 0
    assert pool.num_free == 3
    with pytest.raises(ValueError):
        pool.decref(b)
    with pytest.raises(ValueError):
        pool.incref(b)
    with pytest.raises(ValueError):
        pool.incref(0)
    pool.check_invariants()


def test_host_pool_without_null_block():
    pool = BlockPool(2, reserve_null=False)
    assert pool.allocate(2) == [0, 1]
    empty = BlockPool(0, reserve_null=False)
    assert empty.num_free == 0
    with pytest.raises(ValueError):
        BlockPool(1)


def test_check_invariants_detects_corruption():
    pool = BlockPool(4)
    pool.allocate(1)
    pool.ref_counts[2] = 1  # still on the free queue
    with pytest.raises(AssertionError, match="block 2"):
        pool.check_invariants()
