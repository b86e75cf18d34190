"""The radix tree's node and the small typed results of its operations (radix/tree.py).

A node is one full block of tokens. It is resident on the device tier (``block_id`` >= 0, a block of the device
BlockPool), on the host tier (``host_block`` >= 0, a block of the host tier's BlockPool, radix/host_tier.py), or on
both. Device residency is prefix-closed: the parent of a device-resident node is device-resident too (or a root), so a
match is a device-resident prefix followed by a host-only suffix, and a host-only node's children are host-only.
"""

from __future__ import annotations

from typing import NamedTuple

from radix.hashing import BlockHash

ID_BITS = 32
ID_MASK = (1 << ID_BITS) - 1
NOT_RESIDENT = -1  # block_id / host_block of a node that is not on that tier


class Node:
    """One cached block (or, as a Root, the root of one salt's subtree). Owned by the RadixTree; callers hold a Node
    only as an opaque handle (PrefixMatch.last_node / host_nodes, SeqBlocks.cached_node) while they reference it.

    block_id: device block (NOT_RESIDENT: host only). host_block: host-tier block (NOT_RESIDENT: device only).
    key: the block's packed tokens (the parent's children dict key). children: None until the first child.
    lru_key: last_access << 32 | block_id (the device LRU's key, meaningful while device-evictable).
    host_lru_key: last_access << 32 | host_block (the host LRU's key); host_listed: it is in the host LRU now.
    num_device_children: children that are device-resident (0: a device leaf, evictable from the device first).
    """

    __slots__ = (
        "block_id",
        "host_block",
        "block_hash",
        "key",
        "parent",
        "children",
        "lru_key",
        "host_lru_key",
        "host_listed",
        "num_device_children",
    )

    def __init__(self, block_id: int, block_hash: BlockHash | None, key: bytes, parent: Node | None, lru_key: int):
        self.block_id = block_id
        self.host_block = NOT_RESIDENT
        self.block_hash = block_hash
        self.key = key
        self.parent = parent
        self.children: dict[bytes, Node] | None = None
        self.lru_key = lru_key
        self.host_lru_key = 0
        self.host_listed = False
        self.num_device_children = 0


class Root(Node):
    """The root of one cache_salt's subtree (no block, on no tier; counts as device-resident for prefix closure)."""

    __slots__ = ("salt",)

    def __init__(self, salt: str | None) -> None:
        super().__init__(NOT_RESIDENT, None, b"", None, 0)
        self.salt = salt


def salt_under(parent: Node | None) -> str | None:
    """The cache_salt a block hanging directly under ``parent`` is hashed with: the salt of a salted Root, else
    None (a block under another block, or under the unsalted root). For KV events (radix/events.py)."""
    return parent.salt if type(parent) is Root else None


class TreeMatch(NamedTuple):
    """Cached prefix: the device-resident blocks root first (block_ids), then the host-only nodes that follow them
    (host_nodes, parent first: loading them back extends the device prefix), and the last matched node of either
    tier (None when nothing matched)."""

    block_ids: list[int]
    last_node: Node | None
    host_nodes: list[Node] = []


class InsertResult(NamedTuple):
    """resident: the tree's device block for each processed block (a prefix of the input; shorter after a hash
    collision). duplicates: given block ids that were not inserted because an identical block is resident and in use
    (the caller keeps and later releases them). last_node: the node of the last resident block (the given parent
    when none)."""

    resident: list[int]
    duplicates: list[int]
    last_node: Node | None
