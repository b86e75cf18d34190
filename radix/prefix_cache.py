"""PrefixCache: what the KVCacheManager asks of its prefix cache, with two implementations chosen once when the
manager is built: RadixTree (radix/tree.py, prefix caching on) and NoPrefixCache (radix/no_cache.py, off). The shape
follows mini-sglang's BasePrefixCache and its naive cache: a disabled cache is a class, not a flag read at every call.

Contract shared by both: the cache holds one reference (BlockPool ref count) to each block it keeps on the device;
lock / unlock add and drop the references of block tables (cached blocks or not), so a block nobody references goes
back to the pool's free queue; ``epoch`` changes whenever blocks leave the cache or move between tiers, so a match
taken at another epoch may name blocks that are gone (radix/prefix_match.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from radix.hashing import BlockHash
from radix.keys import BlockKeys
from radix.node import Node, TreeMatch
from radix.sequence import SeqBlocks


class PrefixCache(ABC):
    """The prefix cache of one KVCacheManager over its device BlockPool (see the module docstring).

    Each implementation states its complexities: RadixTree O(blocks touched) dict probes plus O(log n) per block
    entering or leaving its LRU; NoPrefixCache O(1), or O(blocks) for lock / unlock.
    """

    @property
    @abstractmethod
    def epoch(self) -> int:
        """Counts the calls that removed blocks from a tier or moved a node between tiers. O(1)."""

    @property
    @abstractmethod
    def num_cached(self) -> int:
        """Device blocks the cache holds. O(1)."""

    @property
    @abstractmethod
    def num_evictable(self) -> int:
        """Device blocks whose only reference is the cache's (evict can free them). O(1)."""

    @abstractmethod
    def block_keys(self, token_ids: Sequence[int], cache_salt: str | None) -> BlockKeys:
        """The keys of token_ids this cache matches by (radix/keys.py). Pure, O(len(token_ids)).

        Raises ValueError: a bad token id."""

    @abstractmethod
    def match(self, blocks: Sequence[bytes], salt: str | None, max_blocks: int) -> TreeMatch:
        """Longest cached prefix of ``blocks`` (packed tokens) in salt's subtree, at most max_blocks, on either tier.
        Pure: takes no reference, hashes nothing."""

    @abstractmethod
    def lock(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (cached or not). Raises ValueError: a block is free (nothing after it is
        locked)."""

    @abstractmethod
    def unlock(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; a block left with none goes to the free queue, in order. Raises
        ValueError: a block is already free (nothing after it is unlocked)."""

    @abstractmethod
    def evict(self, n: int) -> list[int]:
        """Free up to n evictable device blocks; returns them in eviction order (now on the free queue)."""

    @abstractmethod
    def pin_for_load(self, nodes: Sequence[Node]) -> None:
        """Pin the host copies of a matched host-only chain before device blocks are taken for it. Raises ValueError:
        a node is not host-only (a stale match)."""

    @abstractmethod
    def load_back(self, nodes: Sequence[Node], device_blocks: Sequence[int]) -> None:
        """Give each pinned host-only node its device block (allocated by the caller) and schedule the copies.
        Raises ValueError: lengths differ, or a device block is free or already cached."""

    @abstractmethod
    def cache_full_blocks(self, seq: SeqBlocks, num_full_blocks: int) -> None:
        """Cache seq's full blocks [seq.num_cached_blocks, num_full_blocks) (their KV written), de-duplicating.
        Mutates seq's cached prefix (num_cached_blocks, cached_node, shadow) and the cache."""

    @abstractmethod
    def uncache_past(self, seq: SeqBlocks, keep_blocks: int) -> None:
        """Take seq's cached blocks from keep_blocks on out of the cache where only seq (and the cache) holds them.
        Mutates seq's cached prefix and the cache."""

    @abstractmethod
    def resident_block(self, block_hash: BlockHash) -> int | None:
        """Device block id cached under block_hash, None if absent or on the host only. O(1)."""

    @abstractmethod
    def hashes(self) -> list[BlockHash]:
        """Hashes of the device-resident blocks (insertion order). O(cached blocks)."""

    @abstractmethod
    def host_hashes(self) -> list[BlockHash]:
        """Hashes of the blocks with a host copy (insertion order). O(cached blocks)."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Recount the cache's own state from scratch (tests). Raises AssertionError naming the offending block."""
