"""SeqBlocks: the block-table state of one sequence inside the KVCacheManager (owned by it; its cached prefix is
advanced by the manager's prefix cache, radix/prefix_cache.py)."""

from __future__ import annotations

from collections.abc import Sequence

from radix.keys import pack_blocks
from radix.node import Node


class SeqBlocks:
    """One sequence's KV state inside a KVCacheManager.

    blocks / tail / num_tokens: its known tokens (prompt + appended) as packed full blocks (radix/keys.py, each packed
    once: from the request's BlockKeys at admission, then as appended tokens fill a block), the partial last block's
    tokens, and their count.
    block_table: device block ids, block i holds positions [i * B, (i + 1) * B). num_computed: tokens whose KV is
    written. num_cached_blocks / cached_node: the leading blocks already resident in the radix tree and the node of
    the last of them (None when none). shadow: resident duplicates of its own blocks that it also references (so it
    references the whole cached path it stands on). host_table: host block ids while swapped out (block_table is
    then empty), else None.
    """

    __slots__ = (
        "blocks",
        "tail",
        "num_tokens",
        "block_table",
        "num_computed",
        "cache_salt",
        "num_cached_blocks",
        "cached_node",
        "shadow",
        "host_table",
    )

    def __init__(
        self,
        blocks: list[bytes],
        tail: list[int],
        num_tokens: int,
        block_table: list[int],
        num_computed: int,
        cache_salt: str | None,
    ) -> None:
        self.blocks = blocks
        self.tail = tail
        self.num_tokens = num_tokens  # len(blocks) * block_size + len(tail)
        self.block_table = block_table
        self.num_computed = num_computed
        self.cache_salt = cache_salt
        self.num_cached_blocks = 0  # leading blocks resident in the tree (as themselves or as a shadow)
        self.cached_node: Node | None = None  # the tree node of block num_cached_blocks - 1
        self.shadow: list[int] = []  # resident duplicates this sequence references (see the class docstring)
        self.host_table: list[int] | None = None  # set while swapped out

    def copy(self) -> SeqBlocks:
        """A fork: same tokens, table, cached prefix and shadow (the caller takes the extra references). O(blocks)."""
        child = SeqBlocks(
            list(self.blocks),
            list(self.tail),
            self.num_tokens,
            list(self.block_table),
            self.num_computed,
            self.cache_salt,
        )
        child.num_cached_blocks = self.num_cached_blocks
        child.cached_node = self.cached_node
        child.shadow = list(self.shadow)
        return child

    def append_tokens(self, token_ids: Sequence[int], block_size: int) -> None:
        """Record token_ids as known tokens; each block they fill is packed now, once (radix/keys.py).
        O(len(token_ids) + block_size). Raises ValueError: a bad token id (nothing recorded)."""
        tail = self.tail
        if len(tail) + len(token_ids) < block_size:
            tail.extend(token_ids)
        else:
            tokens = tail + list(token_ids)
            full = len(tokens) // block_size * block_size
            self.blocks.extend(pack_blocks(tokens[:full], block_size))
            self.tail = tokens[full:]
        self.num_tokens += len(token_ids)
