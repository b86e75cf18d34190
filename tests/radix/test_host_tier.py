"""The host tier of the radix tree (radix/host_tier.py, radix/tier_moves.py): write back on eviction, load back on a
hit, pins of pending copies, host LRU, per-tier invariants, events with a medium. Exact block ids throughout (bs=4)."""

from __future__ import annotations

from radix.events import AllBlocksCleared, BlockRemoved, BlockStored
from radix.hashing import hash_block_tokens
from radix.host_tier import TierCopies
from radix.manager import KVCacheManager
from tests.radix.radix_testing import admit, match, ref_count, toks


def finished(m: KVCacheManager, seq_id: int, tokens: list[int], commit: bool = True) -> None:
    """Admit, compute everything (or nothing), free."""
    assert admit(m, seq_id, tokens) is not None
    if commit:
        m.commit_computed(seq_id, len(tokens))
    m.free(seq_id)
    m.check_invariants()


def step(m: KVCacheManager) -> TierCopies:
    """What the scheduler does around one step: take the copies into the batch, then (result back) unpin."""
    copies = m.take_tier_copies()
    m.check_invariants()
    m.tier_copies_done()
    m.check_invariants()
    return copies


def tiers(m: KVCacheManager) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    s = m.stats()
    return (
        (s.free_blocks, s.evictable_blocks, s.in_use_blocks),
        (s.host_cache_free_blocks, s.host_cache_evictable_blocks, s.host_cache_in_use_blocks),
    )


def two_blocks_on_host(m: KVCacheManager) -> None:
    """toks(1, 8) cached on the device (blocks 1, 2), then pushed to the host tier (host blocks 0, 1) by a request
    that needs every device block."""
    finished(m, 1, toks(1, 9))  # blocks 1, 2 cached; the partial block 3 freed
    assert admit(m, 2, toks(100, 115)) == 0  # 4 blocks: evicts 2 (the leaf), then 1
    assert m.block_table(2) == [4, 3, 2, 1]
    assert step(m) == TierCopies([(2, 0), (1, 1)], [])
    m.free(2)  # nothing computed: private blocks back to the free queue


def test_eviction_writes_back_and_a_hit_loads_back():
    m = KVCacheManager(5, block_size=4, num_host_cache_blocks=4, record_events=True)
    two_blocks_on_host(m)
    h1, h2 = hash_block_tokens(toks(1, 8), 4)
    events = m.drain_events()
    assert events[1:] == [BlockStored(1, [h2, h1], None, 4, "host"), BlockRemoved(2, [h2, h1])]
    assert m.tree.host_block(h1) == 1 and m.tree.resident_block(h1) is None
    assert m.tree.host_lru_order() == [0]  # only the host-only leaf can go; its parent has a child
    assert tiers(m) == ((4, 0, 0), (2, 2, 0))
    assert m.kv_snapshot().block_hashes == [] and m.kv_snapshot().host_block_hashes == [h1, h2]

    found = m.match_prefix(m.block_keys(toks(1, 13)))
    assert (found.block_ids, [n.host_block for n in found.host_nodes], found.num_tokens) == ([], [1, 0], 8)
    assert m.add_sequence(3, found) == 8  # both tiers count as cached
    assert m.block_table(3) == [4, 3, 2, 1]  # 4, 3 receive the loaded blocks
    assert m.waits_for_loads(3)
    assert m.drain_events() == [BlockStored(3, [h1, h2], None, 4)]
    assert tiers(m) == ((0, 0, 4), (2, 0, 2))  # the two host copies are pinned by their pending loads
    assert step(m) == TierCopies([], [(1, 4), (0, 3)])
    assert not m.waits_for_loads(3)
    assert m.tree.host_lru_order() == [0, 1]  # on both tiers now: redundant copies, loaded at the same tick
    stats = m.stats()
    assert (
        stats.prefix_hits_tokens,
        stats.prefix_host_hits_tokens,
        stats.written_back_blocks,
        stats.loaded_back_blocks,
        stats.host_cached_blocks,
    ) == (8, 8, 2, 2, 2)
    m.commit_computed(3, 13)
    m.free(3)
    assert tiers(m) == ((1, 3, 0), (2, 2, 0)) and m.stats().cached_blocks == 3  # + toks(9, 12) computed
    m.check_invariants()


def test_a_request_aborted_while_its_loads_are_pending_returns_every_block_of_both_tiers():
    m = KVCacheManager(5, block_size=4, num_host_cache_blocks=4)
    two_blocks_on_host(m)
    assert admit(m, 3, toks(1, 13)) == 8 and m.waits_for_loads(3)
    m.free(3)  # aborted: the loads are still pending
    m.check_invariants()
    # the loaded blocks stay cached, held by their pending load (as are their host sources) until the step is done
    assert tiers(m) == ((2, 0, 2), (2, 0, 2))
    assert step(m) == TierCopies([], [(1, 4), (0, 3)])  # the step in flight still carries them
    assert tiers(m) == ((2, 2, 0), (2, 2, 0))
    assert m.tree.clear()
    assert tiers(m) == ((4, 0, 0), (4, 0, 0))


def test_a_host_tier_full_of_pinned_blocks_never_blocks_admission():
    m = KVCacheManager(5, block_size=4, num_host_cache_blocks=2, record_events=True)
    two_blocks_on_host(m)  # the host tier is full: host blocks 0, 1
    finished(m, 4, toks(200, 208))  # blocks 4, 3 cached on the device, block 2 freed
    m.drain_events()
    assert admit(m, 3, toks(1, 13)) == 8  # it loads both host blocks back, which pins the whole host tier
    # the device blocks it evicted for room (3, then its parent 4) could not be written back: dropped
    h200, h204 = hash_block_tokens(toks(200, 207), 4)
    assert m.drain_events()[0] == BlockRemoved(4, [h204, h200])
    assert m.block_table(3) == [1, 2, 3, 4] and m.waits_for_loads(3)
    assert step(m) == TierCopies([], [(1, 1), (0, 2)])
    assert tiers(m) == ((0, 0, 4), (0, 2, 0))
    m.free(3)
    m.check_invariants()


def test_host_lru_drops_the_least_recently_used_copy_when_full():
    m = KVCacheManager(5, block_size=4, num_host_cache_blocks=2, record_events=True)
    two_blocks_on_host(m)
    finished(m, 4, toks(200, 208))  # blocks 4, 3 on the device; host: toks(1, 8) in host 1 (parent), 0 (leaf)
    m.drain_events()
    assert admit(m, 5, toks(300, 315)) == 0  # 4 blocks: evicts 3 then 4; each needs a host block
    # 3 takes host 0 (its leaf toks(5, 8) dropped: the only droppable copy); then toks(1, 4) is a host leaf: 4 takes 1
    h1, h2 = hash_block_tokens(toks(1, 8), 4)
    h200, h204 = hash_block_tokens(toks(200, 207), 4)
    assert m.drain_events() == [
        BlockStored(4, [h204, h200], None, 4, "host"),
        BlockRemoved(5, [h204, h200]),
        BlockRemoved(6, [h2, h1], "host"),
    ]
    assert step(m) == TierCopies([(3, 0), (4, 1)], [])
    assert match(m, toks(1, 13)) == ([], 0)
    m.free(5)
    assert admit(m, 6, toks(200, 209)) == 8  # the written-back chain loads back
    assert step(m) == TierCopies([], [(1, 1), (0, 2)])
    m.free(6)
    m.check_invariants()


def test_a_recomputed_host_only_block_becomes_its_device_copy():
    m = KVCacheManager(5, block_size=4, num_host_cache_blocks=4, record_events=True)
    two_blocks_on_host(m)
    m.drain_events()
    assert admit(m, 3, toks(1, 4)) == 0  # 4 tokens: the match stops one token short, so block 1 is computed
    m.commit_computed(3, 4)  # inserting it finds the host-only node: the new block becomes its device copy
    h1 = hash_block_tokens(toks(1, 4), 4)[0]
    assert m.tree.resident_block(h1) == 4 and m.tree.host_block(h1) == 1
    assert m.drain_events() == [BlockStored(3, [h1], None, 4)]
    assert ref_count(m, 4) == 2
    m.free(3)
    assert match(m, toks(1, 13)) == ([4], 8)  # device block 4, then toks(5, 8) on the host
    assert m.take_tier_copies() == TierCopies([], [])
    m.check_invariants()


def test_reset_clears_both_tiers_unless_a_copy_is_pending():
    m = KVCacheManager(5, block_size=4, num_host_cache_blocks=4, record_events=True)
    finished(m, 1, toks(1, 9))
    assert admit(m, 2, toks(100, 115)) == 0  # write-backs pending
    m.free(2)
    assert not m.tree.clear()
    step(m)
    m.drain_events()
    assert m.tree.clear()
    assert m.drain_events() == [AllBlocksCleared(3)]
    assert tiers(m) == ((4, 0, 0), (4, 0, 0)) and m.kv_snapshot().host_block_hashes == []
    m.check_invariants()


def test_tier_ids_follow_the_swap_pool_in_the_workers_host_tensor():
    m = KVCacheManager(5, block_size=4, num_host_blocks=3, num_host_cache_blocks=4)
    finished(m, 1, toks(1, 9))
    assert admit(m, 2, toks(100, 115)) == 0
    assert m.take_tier_copies() == TierCopies([(2, 3), (1, 4)], [])  # tier blocks 0, 1 are worker host 3, 4
    m.tier_copies_done()
    m.free(2)
    m.check_invariants()


def test_without_prefix_caching_there_is_no_tier():
    m = KVCacheManager(5, block_size=4, enable_prefix_caching=False, num_host_cache_blocks=4)
    finished(m, 1, toks(1, 9))
    assert m.stats().host_cache_total_blocks == 0 and m.take_tier_copies() == TierCopies([], [])
