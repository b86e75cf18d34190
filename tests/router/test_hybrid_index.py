"""The router's ReplicaIndex with a hybrid replica (radix/hybrid_manager.py, a sliding-window group): fed a real
manager's KV events (and, apart, its snapshot), the index cuts each prompt's cached prefix where the replica's own
match cuts it, on both tiers, through window evictions, tree evictions, write-backs and load-backs."""

from __future__ import annotations

from radix.hashing import hash_block_tokens
from radix.hybrid_manager import HybridKVCacheManager
from router.index import ReplicaIndex, TierPrefix
from tests.radix.radix_testing import admit, toks

B = 4
W = 10  # cdiv(10, 4) = 3 window blocks before a hit


def _replica() -> HybridKVCacheManager:
    return HybridKVCacheManager(12, B, num_window_blocks=24, window=W, record_events=True, num_host_cache_blocks=6)


def _turn(m: HybridKVCacheManager, seq_id: int, tokens: list[int]) -> None:
    admit(m, seq_id, tokens)
    m.commit_computed(seq_id, len(tokens))
    m.take_tier_copies()
    m.tier_copies_done()
    m.free(seq_id)


def _replica_prefix(m: HybridKVCacheManager, query: list[int]) -> TierPrefix:
    """What the replica's match gives for query's full blocks (one more token, so the match is not capped)."""
    found = m.match_prefix(m.block_keys(query + [7]))
    return TierPrefix(len(found.block_ids), len(found.host_nodes))


def _agree(m: HybridKVCacheManager, index: ReplicaIndex, queries: list[list[int]]) -> list[TierPrefix]:
    for event in m.drain_events():
        assert index.apply(event)
    fresh = ReplicaIndex()
    assert fresh.load_snapshot(m.kv_snapshot())
    out = []
    for q in queries:
        want = _replica_prefix(m, q)
        hashes = hash_block_tokens(q, B)
        assert index.tier_prefix(hashes) == want == fresh.tier_prefix(hashes), q
        out.append(want)
    return out


def test_the_index_cuts_where_a_hybrid_replica_cuts() -> None:
    m = _replica()
    index = ReplicaIndex()
    assert index.load_snapshot(m.kv_snapshot())
    a = toks(1, 24)  # six blocks
    b = toks(100, 120)  # five blocks
    queries = [a, a[:12], b, a[:8] + b[:8]]
    _turn(m, 1, a)
    assert _agree(m, index, queries) == [(6, 0), (3, 0), (0, 0), (2, 0)]
    assert index.window_blocks == 3
    m._window.evict(2)  # a's blocks 0 and 1 lose their window: hits at 1..4 blocks need them, not 5 or 6
    assert _agree(m, index, queries) == [(6, 0), (0, 0), (0, 0), (0, 0)]
    _turn(m, 2, b)  # 11 usable device blocks: a's are written back to the host tier as b needs room
    prefixes = _agree(m, index, queries)
    assert prefixes[2] == (5, 0) and sum(prefixes[0]) == 6 and prefixes[0].host > 0
    m._window.evict(3)  # the least recently released window blocks: a's 2, 3, 4
    assert _agree(m, index, queries)[0] == (0, 0)
    _turn(m, 3, a + [9])  # computed again: every window block of a is back
    assert _agree(m, index, queries)[0] == (6, 0)
    m.tree.clear()
    assert _agree(m, index, queries) == [(0, 0)] * 4
