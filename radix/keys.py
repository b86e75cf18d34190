"""BlockKeys: the per-block keys of one token sequence, computed once and reused by every radix/ and scheduler step.

A request's prompt is turned into BlockKeys once (at add_request); lpm ordering, admission (match_prefix, then
add_sequence with that match), in-flight dedup and commit all reuse it, and the KVCacheManager extends its own copy as
sampled tokens arrive, so no block's tokens are packed twice and nothing here hashes cryptographically.

- ``blocks[i]``: the tokens of full block i packed as uint32 little endian (radix/hashing.py ``pack_tokens``). The
  radix tree keys a node's children by exactly these bytes: exact comparison, Python's native bytes hashing (cached
  on the bytes object, so a second lookup with the same object does not rehash). The tree keeps the very same objects
  as node keys, so a cached block costs no second copy of its tokens.
- ``tail``: the tokens past the last full block (fewer than block_size).
- ``salt``: the tenant's cache_salt; the tree keeps one subtree per salt under its root, so tenants never share.
- ``chain_ids``: in-process ids of each block's whole prefix, ``id_i = hash((id_{i-1}, blocks[i]))`` seeded with the
  salt; the scheduler compares them to find blocks another running request is computing right now (in-flight dedup).
  They use Python's ``hash()`` (per process, 64 bits): never sent anywhere, never a cache lookup; a collision can only
  make a request wait one step for a block it would not have shared. Computed on first use, O(blocks). Keys made
  with ``chained=False`` (by a manager without prefix caching, radix/no_cache.py) have none and hash nothing: no
  block is shared, so there is nothing to wait for.

The content hash that names a block in KV events (BLAKE2b, radix/hashing.py) is not computed here: the tree computes
it once per block, when the block first enters the tree.
"""

from __future__ import annotations

from collections.abc import Sequence

from radix.hashing import pack_tokens


class BlockKeys:
    """Keys of a token sequence's full blocks plus its partial tail (see the module docstring).

    Args:
        token_ids: the tokens (ints in [0, 2**32)).
        block_size: tokens per block (>= 1).
        cache_salt: tenant salt (None: the shared subtree).
        chained: give chain_ids (False: chain_ids is always [], and so is that of every extended() key).
    Raises:
        ValueError: block_size < 1 or a bad token id.
    O(len(token_ids)): one C-level pack of the whole sequence, then one bytes slice per block.
    Treat as immutable once made (the KVCacheManager copies what it extends).
    """

    __slots__ = ("block_size", "salt", "blocks", "tail", "chained", "_chain_ids")

    def __init__(
        self, token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, *, chained: bool = True
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.salt = cache_salt
        self.blocks: list[bytes] = pack_blocks(token_ids, block_size)
        self.tail: list[int] = list(token_ids[len(self.blocks) * block_size :])
        self.chained = chained
        self._chain_ids: list[int] | None = None if chained else []

    @property
    def num_tokens(self) -> int:
        """Tokens covered: full blocks plus the tail."""
        return len(self.blocks) * self.block_size + len(self.tail)

    def __len__(self) -> int:
        """Number of full blocks."""
        return len(self.blocks)

    @property
    def chain_ids(self) -> list[int]:
        """In-process chained prefix ids, one per full block (in-flight dedup only; [] when not chained). Computed
        once, O(blocks)."""
        ids = self._chain_ids
        if ids is None:
            ids = []
            parent = hash(("radixserve/prefix", self.salt))
            for block in self.blocks:
                parent = hash((parent, block))
                ids.append(parent)
            self._chain_ids = ids
        return ids

    def extended(self, token_ids: Sequence[int]) -> BlockKeys:
        """Keys of ``token_ids``, a sequence that starts with the tokens these keys cover (a preempted sequence's
        prompt + output). Returns self when it covers no more tokens; else a new BlockKeys that shares these full
        blocks and packs only the rest. O(len(token_ids) - blocks * block_size). Mutates nothing.

        Raises:
            ValueError: token_ids is shorter than the tokens covered, or a bad token id.
        """
        n = self.num_tokens
        if len(token_ids) == n:
            return self
        if len(token_ids) < n:
            raise ValueError(f"extended() to {len(token_ids)} tokens, fewer than the {n} covered")
        bs = self.block_size
        start = len(self.blocks) * bs
        out = BlockKeys.__new__(BlockKeys)
        out.block_size = bs
        out.salt = self.salt
        out.chained = self.chained
        out._chain_ids = None if self.chained else []
        rest = token_ids[start:]
        more = pack_blocks(rest, bs)
        out.blocks = self.blocks + more
        out.tail = list(rest[len(more) * bs :])
        return out


def pack_blocks(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """``pack_tokens`` of each full block of token_ids (a trailing partial block is left out, but its tokens are
    checked too). Pure, O(len(token_ids)).

    Raises ValueError: a bad token id.
    """
    packed = pack_tokens(token_ids)
    width = 4 * block_size
    return [packed[i : i + width] for i in range(0, len(token_ids) // block_size * width, width)]
