"""NoPrefixCache: the prefix cache of a manager built without prefix caching (mini-sglang's naive cache): it keeps
nothing, so every match is empty, nothing is ever evictable and a finished sequence's blocks all go back to the free
queue. Its keys have no chain ids (radix/keys.py), so the scheduler's in-flight dedup finds nothing to wait for and
lpm ordering sees zero matches everywhere: no caller asks whether caching is on.
"""

from __future__ import annotations

from collections.abc import Sequence

from radix.block_pool import BlockPool
from radix.hashing import BlockHash
from radix.keys import BlockKeys
from radix.node import Node, TreeMatch
from radix.prefix_cache import PrefixCache
from radix.sequence import SeqBlocks


class NoPrefixCache(PrefixCache):
    """A prefix cache that caches nothing, over the device BlockPool ``pool`` of ``block_size``-token blocks.

    lock / unlock are the pool's incref / decref (a block table's references); every other operation does nothing
    or finds nothing, in O(1). Mutates only the pool's ref counts and free queue.
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size

    @property
    def epoch(self) -> int:
        """Always 0: no block ever leaves a cache that holds none, so no match goes stale."""
        return 0

    @property
    def num_cached(self) -> int:
        """Always 0."""
        return 0

    @property
    def num_evictable(self) -> int:
        """Always 0."""
        return 0

    def block_keys(self, token_ids: Sequence[int], cache_salt: str | None) -> BlockKeys:
        """Keys without chain ids (nothing is shared, so nothing is waited for). Pure, O(len(token_ids)). Raises
        ValueError: a bad token id."""
        return BlockKeys(token_ids, self.block_size, cache_salt, chained=False)

    def match(self, blocks: Sequence[bytes], salt: str | None, max_blocks: int) -> TreeMatch:
        """Nothing cached: an empty match. O(1)."""
        return TreeMatch([], None, [])

    def lock(self, block_ids: Sequence[int]) -> None:
        """One more reference to each block. O(len(block_ids)). Raises ValueError: a block is free (nothing after it
        is locked)."""
        incref = self.pool.incref
        for block_id in block_ids:
            incref(block_id)

    def unlock(self, block_ids: Sequence[int]) -> None:
        """One reference less on each block; one left with none joins the free queue, in order. O(len(block_ids)).
        Raises ValueError: a block is already free (nothing after it is unlocked)."""
        decref = self.pool.decref
        for block_id in block_ids:
            decref(block_id)

    def evict(self, n: int) -> list[int]:
        """Nothing to evict: []. O(1)."""
        return []

    def pin_for_load(self, nodes: Sequence[Node]) -> None:
        """Only an empty chain can come from an empty match. Raises ValueError for any node. O(1)."""
        if nodes:
            raise ValueError("load of a node from a cache that holds none")

    def load_back(self, nodes: Sequence[Node], device_blocks: Sequence[int]) -> None:
        """Only an empty chain can come from an empty match. Raises ValueError for any node or block. O(1)."""
        if nodes or device_blocks:
            raise ValueError(f"load_back of {len(nodes)} nodes into blocks {list(device_blocks)}")

    def cache_full_blocks(self, seq: SeqBlocks, num_full_blocks: int) -> None:
        """Caches nothing: seq keeps no cached prefix. O(1)."""

    def uncache_past(self, seq: SeqBlocks, keep_blocks: int) -> None:
        """Nothing was cached. O(1)."""

    def resident_block(self, block_hash: BlockHash) -> int | None:
        """Always None."""
        return None

    def hashes(self) -> list[BlockHash]:
        """Always []."""
        return []

    def host_hashes(self) -> list[BlockHash]:
        """Always []."""
        return []

    def check_invariants(self) -> None:
        """No state of its own: nothing to check (the pool's references are the manager's check)."""
