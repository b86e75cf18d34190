"""ReplicaIndex (events in order, gaps, snapshot replay, restart), Policy decisions, RouterArgs checks, merge_stats."""

from __future__ import annotations

import pytest

from radix.events import AllBlocksCleared, BlockRemoved, BlockStored, KvSnapshot
from radix.hashing import hash_block_tokens
from router.config import InvalidRouterConfig, RouterArgs
from router.index import ReplicaIndex
from router.policy import Candidate, Decision, Policy
from router.stats import merge_stats
from runtime import protocol as p

H = hash_block_tokens(list(range(64)), 16)  # 4 chained block hashes


def _synced(last_seq: int = -1, hashes=()) -> ReplicaIndex:
    index = ReplicaIndex()
    assert index.load_snapshot(KvSnapshot(last_seq, list(hashes)))
    return index


def test_events_in_order_then_a_gap():
    index = _synced()
    assert index.apply(BlockStored(0, H[:3], None, 16))
    assert index.apply(BlockRemoved(1, [H[2]]))
    assert index.hashes == set(H[:2]) and index.last_seq == 1
    assert index.prefix_blocks(H) == 2
    assert not index.apply(BlockStored(3, [H[3]], H[2], 16))  # seq 2 was lost
    assert index.syncing and index.hashes == set(H[:2])  # untouched until the snapshot
    assert index.apply(BlockRemoved(4, [H[0]]))  # buffered
    assert index.load_snapshot(KvSnapshot(3, H[:2] + [H[3]]))  # replays seq 4 only (3 is in the snapshot)
    assert index.hashes == {H[1], H[3]} and index.last_seq == 4 and not index.syncing


def test_snapshot_replay_with_a_gap_asks_again():
    index = ReplicaIndex()
    index.apply(BlockStored(5, [H[0]], None, 16))
    index.apply(BlockStored(9, [H[1]], H[0], 16))
    assert not index.load_snapshot(KvSnapshot(6, [H[0]]))  # 7 and 8 missing between snapshot and buffer
    assert index.syncing


def test_stale_events_ignored_restart_detected_and_clear():
    index = _synced(10, H)
    assert index.apply(BlockRemoved(9, [H[0]]))  # already in the snapshot
    assert index.hashes == set(H)
    assert not index.apply(BlockStored(0, [H[0]], None, 16))  # seq restarts: the replica restarted
    assert index.syncing
    index = _synced(0, H)
    assert index.apply(AllBlocksCleared(1))
    assert index.hashes == set() and index.prefix_blocks(H) == 0


def test_the_index_keeps_each_tier_from_the_events_medium():
    index = _synced()
    assert index.apply(BlockStored(0, H, None, 16))
    assert index.apply(BlockStored(1, [H[3], H[2]], None, 16, "host"))  # evicted and written back, leaf first
    assert index.apply(BlockRemoved(2, [H[3], H[2]]))
    assert (index.hashes, index.host_hashes) == (set(H[:2]), {H[2], H[3]})
    assert index.prefix_blocks(H) == 2 and index.tier_prefix(H) == (2, 2)
    assert index.apply(BlockStored(3, [H[2]], H[1], 16))  # loaded back: on both tiers
    assert index.tier_prefix(H) == (3, 1)
    assert index.apply(BlockRemoved(4, [H[3]], "host"))
    assert index.tier_prefix(H) == (3, 0)
    assert index.load_snapshot(KvSnapshot(9, H[:1], [H[1], H[2]]))
    assert index.tier_prefix(H) == (1, 2)
    assert index.apply(AllBlocksCleared(10))
    assert (index.hashes, index.host_hashes) == (set(), set())


def test_cache_aware_counts_both_tiers_and_prefers_the_device():
    policy = Policy("cache_aware", balance_threshold=4)
    assert policy.choose([Candidate(0, 0, 2), Candidate(1, 0, 1, 3)], 2) == Decision(1, "prefix")  # 4 blocks > 2
    assert policy.choose([Candidate(0, 1, 1, 3), Candidate(1, 1, 3, 1)], 2) == Decision(1, "prefix")  # more on device
    assert policy.choose([Candidate(0, 2, 0, 0), Candidate(1, 1, 0, 0)], 2) == Decision(1, "load")
    assert policy.choose([Candidate(0, 2, 0, 5), Candidate(1, 1, 0, 0)], 2) == Decision(0, "prefix")  # host only


def test_round_robin_takes_turns_over_replicas_in_rotation():
    policy = Policy("round_robin")
    cands = [Candidate(0, 0, 0), Candidate(2, 0, 0)]  # replica 1 is out of rotation
    assert [policy.choose(cands, 3).index for _ in range(4)] == [0, 2, 2, 0]


def test_least_load_and_cache_aware_decisions():
    assert Policy("least_load").choose([Candidate(0, 3, 9), Candidate(1, 1, 0)], 2) == Decision(1, "load")
    policy = Policy("cache_aware", balance_threshold=4)
    assert policy.choose([Candidate(0, 5, 3), Candidate(1, 1, 2)], 2) == Decision(0, "prefix")  # 5 - 1 <= 4
    assert policy.choose([Candidate(0, 6, 3), Candidate(1, 1, 2)], 2) == Decision(1, "load")  # imbalance
    assert policy.choose([Candidate(0, 2, 0), Candidate(1, 1, 0)], 2) == Decision(1, "load")  # no prefix anywhere
    ties = [policy.choose([Candidate(0, 0, 2), Candidate(1, 0, 2)], 2).index for _ in range(2)]
    assert sorted(ties) == [0, 1]  # equal replicas share the work
    with pytest.raises(ValueError):
        Policy("random")


def test_router_args_checked():
    with pytest.raises(InvalidRouterConfig, match="backends"):
        RouterArgs(backends=[])
    with pytest.raises(InvalidRouterConfig, match="policy"):
        RouterArgs(backends=["tcp://127.0.0.1:5557"], policy="fastest")
    with pytest.raises(InvalidRouterConfig, match="health_timeout_s"):
        RouterArgs(backends=["tcp://127.0.0.1:5557"], health_interval_s=2.0, health_timeout_s=1.0)


def test_merge_stats_sums_every_field_and_recomputes_the_ratios():
    per_pos = "spec_decode_num_accepted_tokens_per_pos"
    fields = [f for f in p.ServerStats.__struct_fields__ if f not in ("kv_usage", "hit_rate", per_pos)]
    a = p.ServerStats(**{f: i + 1 for i, f in enumerate(fields)}, **{per_pos: [3, 2, 1]})
    b = p.ServerStats(**{f: 100 * (i + 1) for i, f in enumerate(fields)}, **{per_pos: [40, 30]})
    m = merge_stats([a, b])
    assert {f: getattr(m, f) for f in fields} == {f: 101 * (i + 1) for i, f in enumerate(fields)}
    assert getattr(m, per_pos) == [43, 32, 1]
    assert m.kv_usage == m.num_used_blocks / (m.num_blocks - 2) and m.hit_rate == m.cached_tokens / m.prompt_tokens


def test_merge_stats_sums_replicas():
    a = p.ServerStats(
        num_running=1,
        num_blocks=11,
        num_used_blocks=5,
        prompt_tokens=100,
        cached_tokens=50,
        tokens_per_s=10.0,
        num_preemptions=2,
        num_swaps=1,
        recomputed_tokens=30,
    )
    b = p.ServerStats(
        num_running=2,
        num_blocks=11,
        num_used_blocks=0,
        prompt_tokens=300,
        cached_tokens=250,
        tokens_per_s=5.0,
        num_preemptions=3,
    )
    m = merge_stats([a, b])
    assert (m.num_running, m.num_blocks, m.prompt_tokens, m.cached_tokens) == (3, 22, 400, 300)
    assert m.kv_usage == 5 / 20 and m.hit_rate == 0.75 and m.tokens_per_s == 15.0
    assert (m.num_preemptions, m.num_swaps, m.recomputed_tokens) == (5, 1, 30)
