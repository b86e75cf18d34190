"""What the Scheduler counts: SchedulerCounters (totals since start) and scheduler_stats, the ServerStats snapshot
built from those totals, the queue lengths and the KV manager's KVStats. Pure Python (no torch)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from radix.hybrid_manager import WindowGroupStats
from radix.stats import KVStats
from runtime.protocol import ServerStats


@dataclass
class SchedulerCounters:
    """Totals since the scheduler started. Each name, meaning and unit is that of the ServerStats field of the same
    name (scheduler_stats copies them across by name). Mutated by the Scheduler only."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens_computed: int = 0
    forward_tokens: int = 0
    recomputed_tokens: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    num_swaps: int = 0
    num_rejected: int = 0

    def admitted(self, prompt_tokens: int, cached_tokens: int, host_cached_tokens: int) -> None:
        """Count a request's first admission: its prompt, its cached tokens (both tiers) and those loaded back."""
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.host_cached_tokens += host_cached_tokens


@dataclass
class SpecCounters:
    """vLLM's spec decode counters, totals since start: num_drafts (verify steps of one sequence with a draft),
    num_draft_tokens (tokens proposed), num_accepted_tokens (draft tokens the target accepted), accepted_per_pos
    (position i: drafts whose token i was accepted; length num_speculative_tokens)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


def scheduler_stats(
    counters: SchedulerCounters,
    kv: KVStats,
    num_running: int,
    num_waiting: int,
    num_swapped: int,
    window: WindowGroupStats | None = None,
    spec: SpecCounters | None = None,
) -> ServerStats:
    """ServerStats from the counters, the queue lengths (sequences), kv (blocks exclude the null block, so
    num_blocks = kv.total_blocks + 1), the sliding-window group's counters (None: one group) and spec (speculative
    decoding's counters, the spec_decode_* fields). tokens_per_s is left 0.0: a rate needs an interval, which the
    caller keeps. Pure; O(fields)."""
    c = counters
    if window is not None:
        groups = {
            "num_window_blocks": window.total_blocks + 1,
            "num_window_free_blocks": window.free_blocks,
            "num_window_evictable_blocks": window.evictable_blocks,
            "num_window_used_blocks": window.in_use_blocks,
            "num_window_cached_blocks": window.cached_blocks,
            "num_window_evicted_blocks": window.evicted_blocks,
        }
    else:
        groups = {}
    return ServerStats(
        num_running=num_running,
        num_waiting=num_waiting,
        num_swapped=num_swapped,
        num_blocks=kv.total_blocks + 1,
        num_free_blocks=kv.free_blocks,
        num_evictable_blocks=kv.evictable_blocks,
        num_used_blocks=kv.in_use_blocks,
        num_cached_blocks=kv.cached_blocks,
        kv_usage=kv.in_use_blocks / kv.total_blocks if kv.total_blocks else 0.0,
        hit_rate=c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        num_evicted_blocks=kv.evicted_blocks,
        num_host_cache_blocks=kv.host_cache_total_blocks,
        num_host_cache_free_blocks=kv.host_cache_free_blocks,
        num_host_cache_evictable_blocks=kv.host_cache_evictable_blocks,
        num_host_cache_used_blocks=kv.host_cache_in_use_blocks,
        num_host_cached_blocks=kv.host_cached_blocks,
        num_written_back_blocks=kv.written_back_blocks,
        num_loaded_back_blocks=kv.loaded_back_blocks,
        spec_decode_num_drafts=spec.num_drafts if spec else 0,
        spec_decode_num_draft_tokens=spec.num_draft_tokens if spec else 0,
        spec_decode_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
        spec_decode_num_accepted_tokens_per_pos=list(spec.accepted_per_pos) if spec else [],
        **dataclasses.asdict(c),
        **groups,
    )
