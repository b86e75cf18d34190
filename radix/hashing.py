"""Content hashes of full KV blocks, chained: hash_i = H(hash_{i-1}, tokens_i, extra_keys_i).

The hash input is a fixed byte encoding with unambiguous field boundaries (every variable-length field is
length-prefixed, every extra key carries a type tag), hashed with BLAKE2b (RFC 7693) truncated to 16 bytes. Nothing
depends on Python's ``hash()``, so the same tokens give the same hash in every process whatever PYTHONHASHSEED is;
the router hashes prompts with this module and compares them with the hashes in a replica's KV events.

A tenant's ``cache_salt`` (and any other extra key) enters the first block only; through the chain it changes every
later block's hash too, so two tenants never share a cached block.

The radix tree is walked by the blocks' packed tokens (``pack_tokens``, radix/keys.py), never by these hashes: a block
is hashed once, when it first enters the tree, and the hash only names it (KV events, snapshots, the router's lookup).
``packed_block_key`` turns packed tokens into the hash input's block field without unpacking them.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence

BlockHash = bytes
HashFn = Callable[[bytes], bytes]
ExtraKey = str | int | bytes

HASH_BYTES = 16
_DOMAIN = b"radixserve/block/v1"
_NO_PARENT = b"\x00"
_U32 = struct.Struct("<I")
_NO_EXTRA = _U32.pack(0)
_CHILD_PREFIX = _DOMAIN + b"\x01"


def blake2b_128(data: bytes) -> BlockHash:
    """BLAKE2b (RFC 7693) digest of ``data``, 16 bytes. The default block hash function."""
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


_TOKEN_TYPECODE = "I" if array("I").itemsize == 4 else "L"


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as uint32 little endian, 4 bytes each: a block's exact content, the radix tree's child key.

    Pure, O(len(token_ids)) in C. Raises ValueError: a token id outside [0, 2**32) or not an int.
    """
    try:
        packed = array(_TOKEN_TYPECODE, token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _encode_extra_key(key: ExtraKey) -> bytes:
    if isinstance(key, bool):
        raise ValueError(f"extra key must be str, int or bytes, got bool {key!r}")
    if isinstance(key, str):
        tag = b"s"
        raw = key.encode("utf-8")
    elif isinstance(key, bytes):
        tag = b"b"
        raw = key
    elif isinstance(key, int):
        tag = b"i"
        raw = str(key).encode("ascii")
    else:
        raise ValueError(f"extra key must be str, int or bytes, got {type(key).__name__}")
    return tag + _U32.pack(len(raw)) + raw


def block_key(token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()) -> bytes:
    """Unambiguous encoding of one block's content: token count, tokens (uint32 LE), extra key count, extra keys.

    Args:
        token_ids: the block's token ids (ints in [0, 2**32)).
        extra_keys: keys that must also match (cache_salt on the first block), each str, int or bytes.
    Returns:
        bytes, 8 + 4 * len(token_ids) long without extra keys. Pure.
    Raises:
        ValueError: a token id outside [0, 2**32) or an extra key of another type.
    """
    return packed_block_key(pack_tokens(token_ids), extra_keys)


def packed_block_key(packed_tokens: bytes, extra_keys: Sequence[ExtraKey] = ()) -> bytes:
    """``block_key`` of a block given its ``pack_tokens`` bytes (no unpacking). Pure, O(len(packed_tokens)).

    Raises ValueError: an extra key of another type than str, int or bytes.
    """
    tail = _U32.pack(len(extra_keys)) + b"".join(_encode_extra_key(k) for k in extra_keys) if extra_keys else _NO_EXTRA
    return _U32.pack(len(packed_tokens) // 4) + packed_tokens + tail


def hash_block(parent_hash: BlockHash | None, key: bytes, hash_fn: HashFn = blake2b_128) -> BlockHash:
    """Chained hash of one block: H(domain, parent hash (length-prefixed, or a none marker), key).

    Args:
        parent_hash: hash of the previous block of the sequence, None for the first block.
        key: ``block_key`` of this block.
        hash_fn: bytes -> digest; BLAKE2b-128 by default (tests inject a weak one to force collisions).
    Returns:
        the digest (16 bytes by default). Pure, O(len(key)).
    """
    if parent_hash is None:
        parent_field = _NO_PARENT
    else:
        parent_field = b"\x01" + _U32.pack(len(parent_hash)) + parent_hash
    return hash_fn(_DOMAIN + parent_field + key)


def hash_packed_block(
    parent_hash: BlockHash | None, packed_tokens: bytes, cache_salt: str | None = None, hash_fn: HashFn = blake2b_128
) -> BlockHash:
    """The chained hash of a block given its ``pack_tokens`` bytes: exactly
    ``hash_block(parent_hash, packed_block_key(packed_tokens, extra_keys_for_block(i, cache_salt)), hash_fn)``, with
    the salt entering only the first block (parent_hash None). The radix tree's one call per block new to it, so the
    bytes of a block with a parent are joined here in one expression (no key object, no extra calls).
    Pure, O(len(packed_tokens)).
    """
    if parent_hash is None:
        return hash_block(None, packed_block_key(packed_tokens, extra_keys_for_block(0, cache_salt)), hash_fn)
    return hash_fn(
        _CHILD_PREFIX
        + _U32.pack(len(parent_hash))
        + parent_hash
        + _U32.pack(len(packed_tokens) // 4)
        + packed_tokens
        + _NO_EXTRA
    )


def extra_keys_for_block(block_index: int, cache_salt: str | None) -> tuple[ExtraKey, ...]:
    """Extra keys of block ``block_index``: (cache_salt,) for the first block when a salt is given, else ()."""
    if block_index == 0 and cache_salt is not None:
        return (cache_salt,)
    return ()


def hash_block_tokens(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    hash_fn: HashFn = blake2b_128,
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` (a trailing partial block is not hashed).

    This is what the KV cache manager stores in its radix tree and publishes in KV events, so a router can hash a
    prompt here and ask which replica holds its blocks.

    Args:
        token_ids: token ids (ints in [0, 2**32)).
        block_size: tokens per block (>= 1).
        cache_salt: tenant salt; enters the first block's hash.
        hash_fn: digest function (default BLAKE2b-128).
    Returns:
        list of len(token_ids) // block_size hashes. Pure, O(len(token_ids)).
    Raises:
        ValueError: block_size < 1 or a bad token id.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    packed = pack_tokens(token_ids)
    width = 4 * block_size
    for i in range(len(token_ids) // block_size):
        key = packed_block_key(packed[i * width : (i + 1) * width], extra_keys_for_block(i, cache_salt))
        parent = hash_block(parent, key, hash_fn)
        hashes.append(parent)
    return hashes
