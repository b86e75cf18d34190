"""ServerStats: the scheduler's counters and KV pool figures, answered to a StatsRequest and published on the stats
topic (runtime/protocol/public.py StatsResponse carries it)."""

from __future__ import annotations

import msgspec


class ServerStats(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A snapshot of the scheduler: Scheduler.stats() builds it, the Engine returns it, the scheduler process serves
    and publishes it, the router sums it over replicas (router.stats.merge_stats). One meaning per name:

    Sequences (a request with n > 1 counts n): num_running, num_waiting, num_swapped (KV moved to the host pool).
    Device KV blocks: num_blocks includes the reserved null block; num_free_blocks: on the free list;
    num_evictable_blocks: in the radix tree and referenced by no sequence (reclaimable);
    num_used_blocks: listed by at least one sequence's block table. num_free_blocks + num_evictable_blocks +
    num_used_blocks == num_blocks - 1. num_cached_blocks: every block in the radix tree, evictable or in use (what a
    KV snapshot lists). kv_usage = num_used_blocks / (num_blocks - 1).
    Token totals since start: prompt_tokens / cached_tokens (each request counted once, at its first admission;
    hit_rate = cached_tokens / prompt_tokens); generated_tokens: sampled completion tokens; prefill_tokens_computed:
    prompt tokens (and recomputed ones) run through the model; forward_tokens: every token run through the model,
    prefill and decode; recomputed_tokens: prompt + output tokens computed again after a recompute preemption (never
    counted as cache hits). tokens_per_s: forward_tokens per second over the scheduler process's last stats interval
    (0.0 from Scheduler.stats(), which keeps no interval). num_steps: forward steps; num_preemptions / num_swaps:
    sequences preempted (either mode) / swapped out; num_rejected: requests refused at admission (RequestRejected);
    num_evicted_blocks: cached blocks evicted from the device pool (LRU, to make room) since start.
    Host tier (0 without one): host_cached_tokens: the part of cached_tokens loaded back from the host tier;
    num_host_cache_blocks = num_host_cache_free_blocks + num_host_cache_evictable_blocks + num_host_cache_used_blocks
    (used: pinned by a copy in flight); num_host_cached_blocks: blocks with a host copy; num_written_back_blocks /
    num_loaded_back_blocks: blocks copied device -> host on eviction / host -> device on a hit, since start.
    Sliding-window KV cache group (0 with one group, kv_groups single; radix/hybrid_manager.py): num_window_blocks
    (null block included) = 1 + num_window_free_blocks + num_window_evictable_blocks + num_window_used_blocks;
    num_window_cached_blocks: window blocks held by radix tree nodes; num_window_evicted_blocks: those evicted since
    start. The device KV block fields above are the full-attention group's.
    Speculative decoding (vLLM's spec_decode_* counters, 0 when off): drafts verified (one per sequence and step),
    draft tokens proposed, draft tokens accepted, and per draft position i the drafts whose token i was accepted.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_evictable_blocks: int = 0
    num_used_blocks: int = 0
    num_cached_blocks: int = 0
    kv_usage: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    hit_rate: float = 0.0
    prefill_tokens_computed: int = 0
    forward_tokens: int = 0
    tokens_per_s: float = 0.0
    num_steps: int = 0
    num_preemptions: int = 0
    num_swaps: int = 0
    recomputed_tokens: int = 0
    num_rejected: int = 0
    num_evicted_blocks: int = 0
    host_cached_tokens: int = 0
    num_host_cache_blocks: int = 0
    num_host_cache_free_blocks: int = 0
    num_host_cache_evictable_blocks: int = 0
    num_host_cache_used_blocks: int = 0
    num_host_cached_blocks: int = 0
    num_written_back_blocks: int = 0
    num_loaded_back_blocks: int = 0
    num_window_blocks: int = 0
    num_window_free_blocks: int = 0
    num_window_evictable_blocks: int = 0
    num_window_used_blocks: int = 0
    num_window_cached_blocks: int = 0
    num_window_evicted_blocks: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
