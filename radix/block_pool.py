"""Physical KV blocks: a FIFO free queue and per-block reference counts.

A block is free at ref count 0 and on the free queue exactly then. Every block table that lists a block holds one
reference, the radix tree holds one reference to each cached block; the pool does not know who holds what.
Blocks are handed out from the front of the free queue and returned to its back, so reuse order is deterministic
(tests assert it). Block 0 is the reserved null block when ``reserve_null`` is set (the device pool): it is never
allocated, so a padded block-table entry (0) never aliases live data. The host (swap) pool has no null block.
"""

from __future__ import annotations

from collections import deque

NULL_BLOCK = 0


class NoFreeBlocksError(RuntimeError):
    """More blocks were requested than the pool has free."""


class BlockPool:
    """Free queue and ref counts of ``num_blocks`` physical blocks (ids 0 .. num_blocks - 1).

    Args:
        num_blocks: physical blocks, including the null block 0 when ``reserve_null`` (then >= 2, else >= 0).
        reserve_null: keep block 0 out of circulation.
    Raises:
        ValueError: too few blocks.
    All operations are O(1) per block.
    """

    def __init__(self, num_blocks: int, reserve_null: bool = True) -> None:
        first = 1 if reserve_null else 0
        if num_blocks < first + (1 if reserve_null else 0) or num_blocks >= 2**32:
            raise ValueError(f"num_blocks must be in [{2 * first}, 2**32), got {num_blocks}")
        self.num_blocks = num_blocks
        self.first_block_id = first
        self.ref_counts: list[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(first, num_blocks))

    @property
    def num_usable(self) -> int:
        """Blocks that can ever be allocated (num_blocks minus the null block)."""
        return self.num_blocks - self.first_block_id

    @property
    def num_free(self) -> int:
        """Blocks on the free queue (ref count 0)."""
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free queue, front (next allocated) first. O(num_free); for tests and invariant checks."""
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue; each gets ref count 1 (the caller's reference).

        Raises:
            ValueError: n < 0.
            NoFreeBlocksError: fewer than n blocks are free (nothing is taken).
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise NoFreeBlocksError(f"requested {n} blocks, only {len(self._free)} free")
        popleft = self._free.popleft
        blocks = [popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, block_id: int) -> int:
        """Add one reference to an allocated block; returns the new ref count.

        Raises:
            ValueError: the block is free or out of range (a free block must be allocated, not increfed).
        """
        self._check_id(block_id)
        count = self.ref_counts[block_id]
        if count == 0:
            raise ValueError(f"incref of free block {block_id}")
        self.ref_counts[block_id] = count + 1
        return count + 1

    def decref(self, block_id: int) -> int:
        """Drop one reference; at 0 the block goes to the back of the free queue. Returns the new ref count.

        Raises:
            ValueError: the block is already free or out of range.
        """
        self._check_id(block_id)
        count = self.ref_counts[block_id]
        if count == 0:
            raise ValueError(f"decref of free block {block_id}")
        count -= 1
        self.ref_counts[block_id] = count
        if count == 0:
            self._free.append(block_id)
        return count

    def release_last(self, block_ids: list[int]) -> None:
        """Drop the last reference of each block (ref count 1 -> 0); they join the back of the free queue in order.

        Raises:
            ValueError: a block's ref count is not 1 (nothing is released).
        """
        rcs = self.ref_counts
        if any(rcs[b] != 1 for b in block_ids):
            raise ValueError(f"release_last of blocks not at ref count 1: {[b for b in block_ids if rcs[b] != 1]}")
        for b in block_ids:
            rcs[b] = 0
        self._free.extend(block_ids)

    def ref_count(self, block_id: int) -> int:
        """Current ref count of a block (0: free)."""
        self._check_id(block_id)
        return self.ref_counts[block_id]

    def _check_id(self, block_id: int) -> None:
        if not self.first_block_id <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} outside [{self.first_block_id}, {self.num_blocks})")

    def check_invariants(self) -> None:
        """Free queue holds each free block once, exactly the blocks at ref count 0. O(num_blocks).

        Raises:
            AssertionError: naming the offending block.
        """
        free = list(self._free)
        seen = set(free)
        assert len(seen) == len(free), f"free queue holds a block twice: {sorted(b for b in seen if free.count(b) > 1)}"
        for b in range(self.first_block_id, self.num_blocks):
            rc = self.ref_counts[b]
            assert rc >= 0, f"block {b} has negative ref count {rc}"
            assert (rc == 0) == (b in seen), f"block {b}: ref count {rc} but on free queue: {b in seen}"
        if self.first_block_id:
            assert self.ref_counts[NULL_BLOCK] == 0 and NULL_BLOCK not in seen, "null block 0 entered circulation"
