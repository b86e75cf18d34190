"""PrefixMatch: the cached prefix match_prefix found, and the rule for when it may still be locked.

A match names physical blocks without holding references on them, so it is valid only while none of its blocks can
have left the radix tree: the tree bumps its epoch on every eviction / uncache / reset, and KVCacheManager.add_sequence
refuses (StaleMatchError) a match whose epoch is no longer the tree's.
"""

from __future__ import annotations

from typing import NamedTuple

from radix.keys import BlockKeys
from radix.node import Node


class StaleMatchError(ValueError):
    """add_sequence got a PrefixMatch taken before blocks left the tree (an eviction, uncache or reset since)."""


class PrefixMatch(NamedTuple):
    """Cached prefix of a token sequence, from match_prefix.

    block_ids: the device-resident cached blocks, root first. host_nodes: the host-only cached blocks after them
    (tree handles, parent first; add_sequence loads them back). num_tokens = (len(block_ids) + len(host_nodes)) *
    block_size: both tiers. keys: the BlockKeys matched (the sequence add_sequence admits). last_node: the tree's
    handle of the last block (None when nothing matched). epoch: the tree's epoch when taken. Valid only until the
    next eviction / uncache / reset / load-back (any of them bumps the epoch; is_current tells): after that its
    blocks may be free, reused or on another tier. Blocks cached after it was taken do not invalidate it, they only
    make it shorter than a new match. With a sliding-window group (radix/hybrid_manager.py): window_blocks, that
    group's cached blocks of the window before the match's end, and window_epoch, its epoch when taken (stale too
    once it moves on).
    """

    block_ids: list[int]
    num_tokens: int
    keys: BlockKeys
    last_node: Node | None
    epoch: int
    host_nodes: list[Node] = []
    window_blocks: list[int] = []
    window_epoch: int = 0

    @property
    def num_host_tokens(self) -> int:
        """The matched tokens whose KV is on the host tier only (loaded back at admission)."""
        return len(self.host_nodes) * self.keys.block_size
