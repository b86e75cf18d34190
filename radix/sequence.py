"""SeqBlocks: the block-table state of one sequence inside the KVCacheManager (owned and mutated only by it)."""

from __future__ import annotations

from radix.tree import Node, RadixTree


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

    def cache_full_blocks(self, tree: RadixTree, num_full_blocks: int) -> None:
        """Insert blocks [num_cached_blocks, num_full_blocks) (capped at the table; their KV must be written) into the
        tree under cached_node, de-duplicating: an idle resident duplicate is replaced by its block (and freed,
        RadixTree.insert_chain); one in use becomes a shadow (one more reference). Mutates this state and the tree.
        O(new blocks) plus one hash per block new to the tree."""
        start, end = self.num_cached_blocks, min(num_full_blocks, len(self.block_table))
        if end <= start:
            return
        table = self.block_table
        found = tree.insert_chain(self.cached_node, self.cache_salt, self.blocks[start:end], table[start:end])
        resident = found.resident
        if not resident:
            return
        shadow = [r for r, b in zip(resident, table[start:end], strict=False) if r != b]  # resident may be shorter
        if shadow:
            tree.lock(shadow)
            self.shadow.extend(shadow)
        self.cached_node = found.last_node
        self.num_cached_blocks += len(resident)

    def uncache_past(self, tree: RadixTree, keep_blocks: int) -> None:
        """Take out of the tree its cached blocks from keep_blocks on that only it (and the tree) holds, deepest
        first, stopping at the first one shared or not its own (a stop string ended the text there). Mutates this
        state and the tree. O(blocks past keep_blocks * log n)."""
        rcs, node = tree.pool.ref_counts, self.cached_node
        own = []  # deepest first
        for i in range(self.num_cached_blocks - 1, keep_blocks - 1, -1):
            assert node is not None
            block_id = self.block_table[i]
            if rcs[block_id] != 2 or node.block_id != block_id:
                break
            own.append(block_id)
            node = node.parent
        removed = tree.uncache(own)
        for _ in range(removed):
            assert self.cached_node is not None
            self.cached_node = self.cached_node.parent
        self.num_cached_blocks -= removed
        if self.num_cached_blocks == 0:
            self.cached_node = None  # the salt's root: insert_chain finds it again
