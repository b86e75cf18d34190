"""KV events: which block hashes a replica's radix tree stores or drops, for routers and metrics.

Each event is a tagged msgspec Struct (runtime/protocol/ imports these for the scheduler's PUB socket) with a
sequence number ``seq`` that grows by exactly 1 per event of one KVCacheManager, so a consumer that sees a jump knows
it missed events and asks for a snapshot (``KvSnapshot``: every resident hash plus the last ``seq`` it reflects).
Hashes are those of radix/hashing.py, 16 bytes each, so a router can hash a prompt itself and compare.
"""

from __future__ import annotations

import msgspec

from radix.hashing import BlockHash


class BlockStored(msgspec.Struct, tag="kv_block_stored", forbid_unknown_fields=True):
    """Blocks entered the radix tree: a chain of ``block_hashes`` (parent first) hanging under ``parent_block_hash``
    (None: the chain starts at the root). ``block_size`` is in tokens."""

    seq: int
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    block_size: int


class BlockRemoved(msgspec.Struct, tag="kv_block_removed", forbid_unknown_fields=True):
    """Blocks left the radix tree (evicted or uncached), in removal order (children before parents)."""

    seq: int
    block_hashes: list[BlockHash]


class AllBlocksCleared(msgspec.Struct, tag="kv_all_blocks_cleared", forbid_unknown_fields=True):
    """The radix tree was emptied at once (prefix cache reset): forget every hash of this replica."""

    seq: int


class KvSnapshot(msgspec.Struct, tag="kv_snapshot", forbid_unknown_fields=True):
    """Every resident block hash, after applying all events up to and including ``last_seq`` (-1: none yet)."""

    last_seq: int
    block_hashes: list[BlockHash]


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventLog:
    """Collects KV events in order, numbering them 0, 1, 2, ...; the owner drains them.

    Mutates only itself. ``enabled=False`` drops events (numbers are then not consumed).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._events: list[KvEvent] = []
        self._next_seq = 0

    @property
    def last_seq(self) -> int:
        """Sequence number of the last event emitted (-1 before the first)."""
        return self._next_seq - 1

    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def stored(self, block_hashes: list[BlockHash], parent_block_hash: BlockHash | None, block_size: int) -> None:
        """Record a BlockStored event (no event for an empty list)."""
        if self.enabled and block_hashes:
            self._events.append(BlockStored(self._take_seq(), block_hashes, parent_block_hash, block_size))

    def removed(self, block_hashes: list[BlockHash]) -> None:
        """Record a BlockRemoved event (no event for an empty list)."""
        if self.enabled and block_hashes:
            self._events.append(BlockRemoved(self._take_seq(), block_hashes))

    def cleared(self) -> None:
        """Record an AllBlocksCleared event."""
        if self.enabled:
            self._events.append(AllBlocksCleared(self._take_seq()))

    def drain(self) -> list[KvEvent]:
        """Return the events collected since the last drain, oldest first, and forget them."""
        events, self._events = self._events, []
        return events


def find_gap(last_seen_seq: int, events: list[KvEvent]) -> int | None:
    """For a consumer: the first sequence number missing between ``last_seen_seq`` and ``events`` (None: no gap).

    Args:
        last_seen_seq: seq of the last event already applied (-1 before any).
        events: newly received events, in order.
    """
    expected = last_seen_seq + 1
    for event in events:
        if event.seq != expected:
            return expected
        expected += 1
    return None
