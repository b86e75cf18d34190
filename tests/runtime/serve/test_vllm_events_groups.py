"""KV events of a hybrid replica (radix/hybrid_manager.py, two KV cache groups) in vLLM's wire format
(runtime/serve/vllm_events/wire.py), decoded with vLLM 0.33's own classes (tests/vllm_peer.py): group_idx per event,
the sliding-window group's stores one per block with parent, tokens and cache-spec kind and window, its removals with
group_idx 1; the bytes are those vLLM's classes encode."""

from __future__ import annotations

import msgspec
import pytest

from radix.events import BlockRemoved, BlockStored
from radix.hashing import hash_block_tokens, pack_tokens
from radix.hybrid_manager import HybridKVCacheManager
from runtime.serve.vllm_events.wire import to_vllm_batch
from tests.radix.radix_testing import admit, toks
from tests.vllm_peer import vllm_kv_events

B = 4
W = 8


@pytest.fixture
def kv():
    return vllm_kv_events()


def test_a_hybrid_replicas_events_carry_their_group(kv):
    m = HybridKVCacheManager(4, B, num_window_blocks=16, window=W, record_events=True, event_token_ids=True)
    h0, h1 = hash_block_tokens(toks(1, 8), B, cache_salt="t")
    admit(m, 1, toks(1, 10), cache_salt="t")
    m.commit_computed(1, 10)
    m.free(1)
    m._window.evict(1)  # block 0's window block
    admit(m, 2, toks(50, 61))  # the whole pool: both cached blocks leave the tree
    m.free(2)
    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    batch = decoder.decode(msgspec.msgpack.encode(to_vllm_batch(m.drain_events(), 1.0, 0, int_hashes=False)))
    got = [(type(e).__name__, e.group_idx, e.block_hashes, getattr(e, "parent_block_hash", None)) for e in batch.events]
    assert got[:6] == [
        ("BlockStored", 0, [h0, h1], None),  # group 0: one chain
        ("BlockStored", 1, [h0], None),  # group 1: one event per block, each with its parent
        ("BlockStored", 1, [h1], h0),
        ("BlockRemoved", 1, [h0], None),  # evicted from group 1 alone
        ("BlockRemoved", 1, [h1], None),  # the node left the tree: its window block first, then group 0's
        ("BlockRemoved", 0, [h1, h0], None),
    ]
    window_stores = batch.events[1:3]
    assert [(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in window_stores] == [
        ("sliding_window", W)
    ] * 2
    assert [e.token_ids for e in window_stores] == [toks(1, 4), toks(5, 8)]
    assert [e.extra_keys for e in window_stores] == [[("t",)], [None]]
    assert (batch.events[0].kv_cache_spec_kind, batch.events[0].kv_cache_spec_sliding_window) == (None, None)


def test_the_group_one_bytes_are_those_vllm_encodes(kv):
    h0, h1 = hash_block_tokens(toks(1, 8), B)
    ours = [
        BlockStored(0, [h0, h1], None, B, "device", pack_tokens(toks(1, 8)), [None, h0], [None, None], 1, W),
        BlockRemoved(1, [h1], group=1),
    ]
    theirs = kv.KVEventBatch(
        ts=2.5,
        events=[
            kv.BlockStored(
                [h0],
                None,
                toks(1, 4),
                B,
                None,
                "GPU",
                None,
                [None],
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=W,
            ),
            kv.BlockStored(
                [h1],
                h0,
                toks(5, 8),
                B,
                None,
                "GPU",
                None,
                [None],
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=W,
            ),
            kv.BlockRemoved([h1], "GPU", group_idx=1),
        ],
        data_parallel_rank=1,
    )
    encode = msgspec.msgpack.encode
    assert encode(to_vllm_batch(ours, 2.5, 1, int_hashes=False)) == encode(theirs)
