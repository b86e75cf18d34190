"""Swap preemption: a sequence's blocks move to a host-memory BlockPool and back (the worker copies the KV).

While swapped out a sequence holds host blocks only (SeqBlocks.host_table) and no device block, cached prefix or
shadow; its tokens (packed blocks) stay, so its full blocks re-enter the tree (de-duplicated) at the next
commit_computed or free after swap_in.
"""

from __future__ import annotations

from radix.block_pool import BlockPool
from radix.prefix_cache import PrefixCache
from radix.sequence import SeqBlocks


def swap_out(seq: SeqBlocks, host_pool: BlockPool, cache: PrefixCache) -> list[tuple[int, int]] | None:
    """Give every block of seq's (live) table a host block and release its device references.

    Returns (device, host) pairs to copy, or None with no side effect when the host pool lacks room. Mutates seq,
    host_pool, the device ref counts and the prefix cache's LRU. O(blocks * log n).
    """
    if len(seq.block_table) > host_pool.num_free:
        return None
    host = host_pool.allocate(len(seq.block_table))
    pairs = list(zip(seq.block_table, host, strict=True))
    cache.unlock(seq.block_table + seq.shadow)
    seq.host_table = host
    seq.block_table = []
    seq.shadow = []
    seq.cached_node = None
    seq.num_cached_blocks = 0
    return pairs


def swap_in(seq: SeqBlocks, host_pool: BlockPool, device: list[int]) -> list[tuple[int, int]]:
    """Make the freshly allocated device blocks seq's table (one per host block) and release its host blocks.

    Returns (host, device) pairs to copy. Mutates seq and host_pool. O(blocks).
    Raises:
        ValueError: seq is not swapped out, or len(device) differs from its host table.
    """
    if seq.host_table is None:
        raise ValueError("sequence is not swapped out")
    pairs = list(zip(seq.host_table, device, strict=True))
    release_host(seq, host_pool)
    seq.block_table = device
    return pairs


def release_host(seq: SeqBlocks, host_pool: BlockPool) -> None:
    """Return a swapped-out seq's host blocks to host_pool (seq.host_table becomes None). O(blocks)."""
    for host_block in seq.host_table or ():
        host_pool.decref(host_block)
    seq.host_table = None
