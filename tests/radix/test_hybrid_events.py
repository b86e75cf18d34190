"""KV events of the sliding-window group (radix/events.py group 1, radix/swa_group.py): exact events when nodes take
window blocks, when group 1 evicts one on its own, when a node leaves the tree, and the snapshot's window hashes."""

from __future__ import annotations

from radix.events import BlockRemoved, BlockStored
from radix.hashing import hash_block_tokens, pack_tokens
from radix.hybrid_manager import HybridKVCacheManager
from tests.radix.radix_testing import admit, toks

B = 4
W = 8


def test_group_one_events_follow_its_window_blocks() -> None:
    m = HybridKVCacheManager(4, B, num_window_blocks=16, window=W, record_events=True)
    h0, h1 = hash_block_tokens(toks(1, 8), B)
    admit(m, 1, toks(1, 10))  # 10 tokens: blocks 0 and 1 full
    m.commit_computed(1, 10)
    assert m.drain_events() == [
        BlockStored(0, [h0, h1], None, B),
        BlockStored(1, [h0, h1], None, B, group=1, sliding_window=W),
    ]
    m.free(1)
    assert m.drain_events() == []  # cached already: nothing new
    assert m._window.evict(1) == [1]  # block 0's window block, released first
    assert m.drain_events() == [BlockRemoved(2, [h0], group=1)]
    snapshot = m.kv_snapshot()
    assert (snapshot.block_hashes, snapshot.window_block_hashes) == ([h0, h1], [h1])
    assert (snapshot.sliding_window, snapshot.block_size, snapshot.last_seq) == (W, B, 2)
    admit(m, 2, toks(50, 61))  # 3 blocks: the whole pool, both cached blocks evicted (no host tier: they leave)
    assert m.drain_events() == [BlockRemoved(3, [h1], group=1), BlockRemoved(4, [h1, h0])]
    assert m.kv_snapshot().window_block_hashes == []
    m.free(2)
    m.check_invariants()


def test_group_one_stored_events_carry_tokens_and_parents() -> None:
    m = HybridKVCacheManager(8, B, num_window_blocks=16, window=W, record_events=True, event_token_ids=True)
    h0, h1 = hash_block_tokens(toks(1, 8), B, cache_salt="t")
    admit(m, 1, toks(1, 9), cache_salt="t")
    m.commit_computed(1, 9)
    window = m.drain_events()[1]
    assert isinstance(window, BlockStored) and window.group == 1
    assert window.token_ids == pack_tokens(toks(1, 8))
    assert (window.block_parents, window.salts) == ([None, h0], ["t", None])
    m.free(1)
    m.check_invariants()
