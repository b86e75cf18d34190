"""Per-sequence state of the KVCacheManager: block table, computed tokens, cached prefix, swap state."""

from __future__ import annotations

from radix.hashing import BlockHash


class SeqState:
    """One sequence's KV state inside a KVCacheManager (owned and mutated only by it).

    token_ids: known tokens (prompt + appended). block_table: device block ids, block i holds positions
    [i * B, (i + 1) * B). num_computed: tokens whose KV is written. block_hashes / num_cached_blocks: the leading
    blocks already resident in the radix tree and their chained hashes. shadow: resident duplicates of its own
    blocks that it also references (so it references the whole cached path it stands on). host_table: host block
    ids while swapped out (block_table is then empty), else None.
    """

    __slots__ = (
        "token_ids", "block_table", "num_computed", "cache_salt",
        "block_hashes", "num_cached_blocks", "shadow", "host_table",
    )  # fmt: skip

    def __init__(self, token_ids: list[int], block_table: list[int], num_computed: int, cache_salt: str | None):
        self.token_ids = token_ids
        self.block_table = block_table
        self.num_computed = num_computed
        self.cache_salt = cache_salt
        self.block_hashes: list[BlockHash] = []  # chained hashes of blocks [0, num_cached_blocks)
        self.num_cached_blocks = 0  # leading blocks resident in the tree (as themselves or as a shadow)
        self.shadow: list[int] = []  # resident duplicates this sequence references (see module docstring)
        self.host_table: list[int] | None = None  # set while swapped out

    def copy(self) -> SeqState:
        """A fork: same tokens, table, cached prefix and shadow (the caller takes the extra references)."""
        child = SeqState(list(self.token_ids), list(self.block_table), self.num_computed, self.cache_salt)
        child.block_hashes = list(self.block_hashes)
        child.num_cached_blocks = self.num_cached_blocks
        child.shadow = list(self.shadow)
        return child
