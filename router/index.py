"""ReplicaIndex: the block hashes resident in one replica's radix tree, on its device and on its host tier, kept from
its KV events (each carries the tier, its medium: radix/events.py).

Events (radix/events.py) carry a sequence number that grows by exactly 1 per event of one replica. The index applies
them in order; an event past the next expected number means messages were lost (ZeroMQ PUB drops under pressure, a
SUB that reconnects misses what was sent meanwhile), so the index reports a gap and the owner asks the replica for a
KvSnapshot instead of drifting. While a snapshot is awaited, events are buffered and those newer than the snapshot
are replayed on top of it.

A replica with a sliding-window KV cache group (radix/hybrid_manager.py) also reports which cached blocks hold their
window block (events of group 1, radix/events.py): its prefix of h blocks is usable only when the window before h,
blocks [max(0, h - cdiv(W, B)), h), is there too, so tier_prefix cuts the prefix where the replica's own match cuts
it (radix/swa_group.py usable_prefix).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from radix.blocks import cdiv
from radix.events import DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvSnapshot
from radix.hashing import BlockHash

WINDOW_GROUP = 1  # the sliding-window group's number in KV events

logger = logging.getLogger(__name__)


class TierPrefix(NamedTuple):
    """A prompt's cached prefix on one replica, in blocks: device (resident on the device), then host (the blocks
    after those that sit on its host tier, which the replica loads back instead of computing)."""

    device: int
    host: int


class ReplicaIndex:
    """Resident block hashes of one replica (hashes: on the device; host_hashes: on its host tier, a block on both
    tiers is in both; window_hashes: the cached blocks holding a window block, and window_blocks = cdiv(W, B), 0
    without a sliding-window group) and the seq of the last event applied.

    Mutates only itself. `syncing` is True from `begin_sync()` until `load_snapshot()`; meanwhile `apply()` buffers.
    Lookups are O(1) per block hash (a Python set).
    """

    def __init__(self) -> None:
        self.hashes: set[BlockHash] = set()
        self.host_hashes: set[BlockHash] = set()
        self.window_hashes: set[BlockHash] = set()
        self.window_blocks = 0
        self.last_seq = -1
        self.syncing = True  # nothing is known until the first snapshot
        self._buffer: list[KvEvent] = []

    def begin_sync(self) -> None:
        """Start buffering events until the next load_snapshot() (the caller has asked for a snapshot)."""
        self.syncing = True

    def load_snapshot(self, snapshot: KvSnapshot) -> bool:
        """Replace the hashes with the snapshot's, then replay buffered events newer than it.

        Returns False when the replay finds a gap (events between the snapshot and the buffer were lost: ask for
        another snapshot; the index stays syncing). Clears the buffer either way.
        """
        self.hashes = set(snapshot.block_hashes)
        self.host_hashes = set(snapshot.host_block_hashes)
        self.window_hashes = set(snapshot.window_block_hashes)
        self.window_blocks = cdiv(snapshot.sliding_window, snapshot.block_size) if snapshot.block_size else 0
        self.last_seq = snapshot.last_seq
        self.syncing = False
        buffered = self._buffer
        self._buffer = []
        for event in buffered:
            if not self.apply(event):
                return False
        return True

    def apply(self, event: KvEvent) -> bool:
        """Apply one event in order. Returns False on a gap (event.seq > last_seq + 1) or a sequence restart
        (seq 0 after later events: the replica restarted); the index then starts syncing and keeps the event
        buffered for the snapshot's replay. Events at or below last_seq are stale (already in a snapshot): ignored.
        """
        if self.syncing:
            self._buffer.append(event)
            return True
        if event.seq <= self.last_seq and not (event.seq == 0 and self.last_seq > 0):
            return True
        if event.seq != self.last_seq + 1:
            logger.warning("KV event gap: expected seq %d, got %d", self.last_seq + 1, event.seq)
            self.syncing = True
            self._buffer = [event]
            return False
        if isinstance(event, BlockStored):
            if event.group == WINDOW_GROUP:
                self.window_blocks = cdiv(event.sliding_window, event.block_size)
            self._set(event.medium, event.group).update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self._set(event.medium, event.group).difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.hashes.clear()
            self.host_hashes.clear()
            self.window_hashes.clear()
        self.last_seq = event.seq
        return True

    def _set(self, medium: str, group: int) -> set[BlockHash]:
        if group == WINDOW_GROUP:
            return self.window_hashes
        return self.hashes if medium == DEVICE else self.host_hashes

    def prefix_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of a prompt's chained hashes that are resident on the device here (blocks, not tokens).
        O(result)."""
        n = 0
        for h in block_hashes:
            if h not in self.hashes:
                break
            n += 1
        return n

    def tier_prefix(self, block_hashes: Sequence[BlockHash]) -> TierPrefix:
        """The leading blocks resident on the device here, then how many of the next ones are on the host tier;
        with a sliding-window group, both cut to the longest prefix whose window is resident (window_prefix).
        O(result)."""
        device = self.prefix_blocks(block_hashes)
        host = 0
        for h in block_hashes[device:]:
            if h not in self.host_hashes:
                break
            host += 1
        if not self.window_blocks:
            return TierPrefix(device, host)
        usable = self.window_prefix(block_hashes[: device + host])
        return TierPrefix(min(device, usable), max(0, usable - device))

    def window_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        """The longest h <= len(block_hashes) whose window blocks [max(0, h - window_blocks), h) are all in
        window_hashes (0 always qualifies): the cut a hybrid replica's match makes. O(len(block_hashes))."""
        best = 0
        run = 0  # window blocks present in a row, ending at block i
        for i, h in enumerate(block_hashes):
            run = run + 1 if h in self.window_hashes else 0
            if run >= min(i + 1, self.window_blocks):
                best = i + 1
        return best

    def clear(self) -> None:
        """Forget everything (the replica went away); syncing until the next snapshot."""
        self.hashes.clear()
        self.host_hashes.clear()
        self.window_hashes.clear()
        self.window_blocks = 0
        self.last_seq = -1
        self.syncing = True
        self._buffer = []
