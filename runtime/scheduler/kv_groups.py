"""The scheduler's side of KV cache groups: which manager a worker's Ready calls for, and the sliding-window group's
part of a step (its block-table deltas and copy-on-write copies). With one group (Ready.num_window_blocks == 0) the
manager is the plain KVCacheManager and each function here adds nothing to a step. Pure Python (no torch)."""

from __future__ import annotations

from radix.hybrid_manager import HybridKVCacheManager, WindowGroupStats, WindowSwaps
from radix.manager import KVCacheManager
from runtime.config import ServerArgs
from runtime.protocol import Ready


def make_manager(
    ready: Ready, args: ServerArgs, *, record_events: bool = False, event_token_ids: bool = False
) -> KVCacheManager:
    """The KVCacheManager sized from the worker's Ready: a HybridKVCacheManager when the worker keeps a
    sliding-window group, else a KVCacheManager. record_events: keep KV events for a publisher; event_token_ids: with
    each stored block's tokens and parent (vLLM's format). Raises ValueError for sizes the manager refuses."""
    if not ready.num_window_blocks:
        return KVCacheManager(
            ready.num_blocks,
            ready.block_size,
            args.enable_prefix_caching,
            ready.num_host_blocks,
            record_events=record_events,
            num_host_cache_blocks=ready.num_host_cache_blocks,
            event_token_ids=event_token_ids,
        )
    return HybridKVCacheManager(
        ready.num_blocks,
        ready.block_size,
        num_window_blocks=ready.num_window_blocks,
        window=ready.sliding_window,
        enable_prefix_caching=args.enable_prefix_caching,
        num_host_blocks=ready.num_host_blocks,
        record_events=record_events,
        num_host_cache_blocks=ready.num_host_cache_blocks,
        event_token_ids=event_token_ids,
    )


def window_delta(manager: KVCacheManager, seq_id: int, sent_blocks: int, first: bool) -> list[int] | None:
    """ScheduledSeq.new_window_block_ids of seq_id: its window table (first: whole, else from sent_blocks, aligned
    with the block-table delta), or None with one group. O(blocks)."""
    if not isinstance(manager, HybridKVCacheManager):
        return None
    table = manager.window_block_table(seq_id)
    return table if first else table[sent_blocks:]


def take_window_copies(manager: KVCacheManager) -> list[tuple[int, int]]:
    """The sliding-window group's copy-on-write pairs made since the last call ([] with one group). O(pairs)."""
    if not isinstance(manager, HybridKVCacheManager):
        return []
    return manager.take_window_copies()


def take_window_swaps(manager: KVCacheManager) -> WindowSwaps:
    """The sliding-window group's swap pairs made since the last call (empty with one group). O(1)."""
    if not isinstance(manager, HybridKVCacheManager):
        return WindowSwaps([], [])
    return manager.take_window_swaps()


def window_stats(manager: KVCacheManager) -> WindowGroupStats | None:
    """The sliding-window group's block counters (None with one group). O(1)."""
    return manager.window_stats() if isinstance(manager, HybridKVCacheManager) else None
