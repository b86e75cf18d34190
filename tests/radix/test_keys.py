"""BlockKeys: packed full blocks + tail, computed once; chain ids for in-flight dedup; extended() for preemption."""

from __future__ import annotations

import pytest

from radix.hashing import block_key, pack_tokens, packed_block_key
from radix.keys import BlockKeys, pack_blocks


def test_blocks_tail_and_counts():
    keys = BlockKeys(list(range(1, 11)), 4, cache_salt="s")
    assert keys.blocks == [pack_tokens([1, 2, 3, 4]), pack_tokens([5, 6, 7, 8])]
    assert keys.tail == [9, 10] and keys.num_tokens == 10 and len(keys) == 2 and keys.salt == "s"
    assert pack_tokens([1, 2]) == b"\x01\x00\x00\x00\x02\x00\x00\x00"  # uint32 little endian
    assert packed_block_key(pack_tokens([1, 2]), ("ab",)) == block_key([1, 2], ("ab",))
    assert BlockKeys([], 4).num_tokens == 0 and pack_blocks([1, 2, 3], 4) == []


def test_chain_ids_name_the_whole_prefix_and_the_salt():
    a = BlockKeys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = BlockKeys([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a.chain_ids is a.chain_ids  # computed once
    assert a.chain_ids[1] != b.chain_ids[1]  # same tokens, other prefix
    assert BlockKeys([1, 2, 3, 4], 4, "s").chain_ids[0] != a.chain_ids[0]
    assert BlockKeys([1, 2, 3, 4, 0], 4).chain_ids == a.chain_ids[:1]


def test_extended_shares_the_blocks_and_packs_the_rest():
    keys = BlockKeys([1, 2, 3, 4, 5, 6], 4, "s")
    assert keys.extended([1, 2, 3, 4, 5, 6]) is keys
    longer = keys.extended([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert longer.blocks[0] is keys.blocks[0]
    fresh = BlockKeys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "s")
    assert (longer.blocks, longer.tail, longer.salt, longer.chain_ids) == (
        fresh.blocks,
        fresh.tail,
        fresh.salt,
        fresh.chain_ids,
    )
    with pytest.raises(ValueError):
        keys.extended([1, 2])


def test_bad_inputs():
    with pytest.raises(ValueError):
        BlockKeys([1], 0)
    for bad in ([-1], [2**32], [1.5]):
        with pytest.raises(ValueError):
            BlockKeys(bad, 4)  # the tail is checked too
