"""KVStats: the KVCacheManager's usage counters, and the one function that counts them."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from radix.block_pool import BlockPool
from radix.host_tier import HostTier
from radix.prefix_cache import PrefixCache
from radix.sequence import SeqBlocks


class KVStats(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """KV usage counters. Blocks exclude the null block; free + evictable + in_use == total.

    cached_blocks: device blocks in the radix tree (evictable or not). prefix_*_tokens: prompt tokens looked up /
    found cached at admission (on either tier); prefix_host_hits_tokens: those of the hits loaded back from the host
    tier. waste_slots: allocated slots minus known tokens, over live (not swapped) sequences. evicted_blocks: cached
    device blocks evicted (LRU) to make room, since the manager was made. host_*: the swap pool.
    Host tier (all 0 without one): host_cache_total_blocks = free + evictable + in_use (in use: pinned by a pending
    copy); host_cached_blocks: blocks with a host copy (on the host only or on both tiers); written_back_blocks /
    loaded_back_blocks: device -> host / host -> device copies scheduled since the start.
    """

    total_blocks: int
    free_blocks: int
    evictable_blocks: int
    in_use_blocks: int
    cached_blocks: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    waste_slots: int
    num_sequences: int
    num_swapped: int
    host_total_blocks: int
    host_free_blocks: int
    evicted_blocks: int = 0
    prefix_host_hits_tokens: int = 0
    host_cache_total_blocks: int = 0
    host_cache_free_blocks: int = 0
    host_cache_evictable_blocks: int = 0
    host_cache_in_use_blocks: int = 0
    host_cached_blocks: int = 0
    written_back_blocks: int = 0
    loaded_back_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """prefix_hits_tokens / prefix_queries_tokens (0.0 before any query)."""
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0


def count_stats(
    pool: BlockPool,
    cache: PrefixCache,
    host_pool: BlockPool,
    seqs: Iterable[SeqBlocks],
    block_size: int,
    queries_tokens: int,
    hits_tokens: int,
    evicted_blocks: int = 0,
    host_hits_tokens: int = 0,
    tier: HostTier | None = None,
) -> KVStats:
    """KVStats of a manager's pools, prefix cache, host tier and sequences. Pure, O(sequences)."""
    free = pool.num_free
    evictable = cache.num_evictable
    total = pool.num_usable
    waste = 0
    swapped = 0
    num_seqs = 0
    for s in seqs:
        num_seqs += 1
        if s.host_table is None:
            waste += max(0, len(s.block_table) * block_size - s.num_tokens)
        else:
            swapped += 1
    return KVStats(
        total_blocks=total,
        free_blocks=free,
        evictable_blocks=evictable,
        in_use_blocks=total - free - evictable,
        cached_blocks=cache.num_cached,
        prefix_queries_tokens=queries_tokens,
        prefix_hits_tokens=hits_tokens,
        waste_slots=waste,
        num_sequences=num_seqs,
        num_swapped=swapped,
        host_total_blocks=host_pool.num_blocks,
        host_free_blocks=host_pool.num_free,
        evicted_blocks=evicted_blocks,
        prefix_host_hits_tokens=host_hits_tokens,
        **({} if tier is None else _tier_stats(tier)),
    )


def _tier_stats(tier: HostTier) -> dict[str, int]:
    pool = tier.pool
    return {
        "host_cache_total_blocks": pool.num_blocks,
        "host_cache_free_blocks": pool.num_free,
        "host_cache_evictable_blocks": tier.num_evictable,
        "host_cache_in_use_blocks": tier.num_pinned,
        "host_cached_blocks": tier.num_cached,
        "written_back_blocks": tier.num_written_back,
        "loaded_back_blocks": tier.num_loaded_back,
    }
