"""RouterStats (the router's own counters) and merge_stats (one ServerStats over several replicas)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime import protocol as p


@dataclass
class RouterStats:
    """Counters since start. routed: requests sent to each replica (by position; a re-sent request counts again).
    by_reason: decisions by Policy reason ("prefix", "load", "turn"). resyncs: snapshots asked after an event gap.
    failures: times a replica was taken out of rotation. resent: unstarted requests re-sent after a failure."""

    routed: list[int]
    by_reason: dict[str, int] = field(default_factory=dict)
    resyncs: int = 0
    failures: int = 0
    resent: int = 0


def merge_stats(stats: list[p.ServerStats]) -> p.ServerStats:
    """The sum of several replicas' ServerStats: every count, block count, token total and tokens_per_s adds up (a
    per-position list, such as spec_decode_num_accepted_tokens_per_pos, position by position);
    the ratios are recomputed from the sums: kv_usage = num_used_blocks / (num_blocks - one null block per replica),
    hit_rate = cached_tokens / prompt_tokens. Pure; O(replicas * fields)."""
    total = p.ServerStats()
    ratios = ("kv_usage", "hit_rate")
    for s in stats:
        for name in p.ServerStats.__struct_fields__:
            if name not in ratios:
                setattr(total, name, _added(getattr(total, name), getattr(s, name)))
    usable = total.num_blocks - len(stats)
    total.kv_usage = total.num_used_blocks / usable if usable > 0 else 0.0
    total.hit_rate = total.cached_tokens / total.prompt_tokens if total.prompt_tokens else 0.0
    return total


def _added(total: int | float | list[int], value: int | float | list[int]) -> int | float | list[int]:
    """total + value; for lists, position by position (the shorter one padded with zeros). O(len)."""
    if isinstance(total, list) and isinstance(value, list):
        width = max(len(total), len(value))
        return [
            a + b for a, b in zip(total + [0] * (width - len(total)), value + [0] * (width - len(value)), strict=True)
        ]
    return total + value  # type: ignore[operator]
