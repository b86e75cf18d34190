from __future__ import annotations

import hashlib

import pytest

from radix.hashing import blake2b_128, block_key, hash_block, hash_block_tokens


def test_hash_block_tokens_is_chained_and_only_full_blocks():
    hashes = hash_block_tokens(list(range(1, 11)), 4)
    assert len(hashes) == 2
    assert all(len(h) == 16 for h in hashes)
    first = hash_block(None, block_key([1, 2, 3, 4]))
    assert hashes[0] == first
    assert hashes[1] == hash_block(first, block_key([5, 6, 7, 8]))
    # the same block content after another parent hashes differently
    assert hash_block_tokens([5, 6, 7, 8], 4)[0] != hashes[1]


def test_encoding_has_unambiguous_boundaries():
    assert block_key([1, 2]) == b"\x02\x00\x00\x00\x01\x00\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00"
    assert block_key([1], ("ab",)) != block_key([1], ("a", "b"))
    assert block_key([1], ("1",)) != block_key([1], (1,))
    assert block_key([1, 2]) != block_key([1], (2,))
    expected = hashlib.blake2b(b"radixserve/block/v1" + b"\x00" + block_key([7]), digest_size=16).digest()
    assert hash_block(None, block_key([7])) == expected
    assert blake2b_128(b"x") == hashlib.blake2b(b"x", digest_size=16).digest()


def test_salt_enters_first_block_and_changes_every_later_one():
    plain = hash_block_tokens(list(range(1, 13)), 4)
    s1 = hash_block_tokens(list(range(1, 13)), 4, cache_salt="s1")
    s1_again = hash_block_tokens(list(range(1, 13)), 4, cache_salt="s1")
    s2 = hash_block_tokens(list(range(1, 13)), 4, cache_salt="s2")
    assert s1 == s1_again
    assert all(a != b for a, b in zip(plain, s1, strict=True))
    assert all(a != b for a, b in zip(s1, s2, strict=True))


def test_bad_inputs():
    with pytest.raises(ValueError):
        hash_block_tokens([1, 2], 0)
    with pytest.raises(ValueError):
        block_key([-1])
    with pytest.raises(ValueError):
        block_key([2**32])
    with pytest.raises(ValueError):
        block_key([1], (1.5,))


def test_hash_packed_block_is_hash_block_of_the_packed_key():
    """The tree's per-block hash (from packed tokens) is the chained hash the router computes from token ids."""
    from radix.hashing import hash_packed_block, pack_tokens

    tokens = list(range(100, 112))
    for salt in (None, "tenant-a"):
        chain = []
        parent = None
        for i in range(3):
            parent = hash_packed_block(parent, pack_tokens(tokens[4 * i : 4 * i + 4]), salt)
            chain.append(parent)
        assert chain == hash_block_tokens(tokens, 4, salt)
    assert hash_packed_block(None, pack_tokens([1, 2]), "s") == hash_block(None, block_key([1, 2], ("s",)))
    parent = hash_block(None, block_key([1, 2]))
    assert hash_packed_block(parent, pack_tokens([3, 4]), "ignored") == hash_block(parent, block_key([3, 4]))
