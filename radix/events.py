"""KV events: which block hashes a replica's radix tree stores or drops, for routers and metrics.

Each event is a tagged msgspec Struct (runtime/protocol/ imports these for the scheduler's PUB socket) with a
sequence number ``seq`` that grows by exactly 1 per event of one KVCacheManager, so a consumer that sees a jump knows
it missed events and asks for a snapshot (``KvSnapshot``: every resident hash plus the last ``seq`` it reflects).
A log that nobody drains for long holds at most ``capacity`` events: the oldest are dropped (their numbers stay
used), so memory stays bounded and the consumer sees the loss as a gap, the same as a message lost on the wire.
Hashes are those of radix/hashing.py, 16 bytes each, so a router can hash a prompt itself and compare.

Tiers: BlockStored and BlockRemoved carry a ``medium``, as vLLM's KV events do: "device" (the device pool, what the
events meant before the host tier) or "host" (the host tier, radix/host_tier.py). A block evicted from the device and
written back is BlockStored(medium="host") then BlockRemoved(medium="device"); one loaded back is
BlockStored(medium="device") (its host copy stays); a consumer that ignores the medium never believes a block is on
the device when it is not. The same hash names a block on either tier.

Token ids: a log made with ``token_ids=True`` puts each stored block's tokens in its BlockStored (``token_ids``: the
tree's packed keys, uint32 little endian, block_size per block, in ``block_hashes`` order) and, in a host-tier one
(not one chain), each block's parent hash (``block_parents``), and per block the cache_salt it was hashed with when it
hangs directly under a salted root (``salts``, else None), for publishers whose wire format carries them (vLLM's,
runtime/serve/vllm_events/); off, those fields stay empty and the events are as small as before.

KV cache groups (radix/hybrid_manager.py): ``group`` names the group an event is about, 0 (full attention: every
event of a single-group manager) or 1 (the sliding-window group, radix/swa_group.py). Group 1's blocks are cached
per tree node under the node's own hash: BlockStored(group=1) when a node takes a window block (``sliding_window``:
the group's window W in tokens, as vLLM's kv_cache_spec_sliding_window; one event per call, not one chain: each
block's parent in block_parents when recorded), BlockRemoved(group=1) when it loses it (evicted on its own, the node
staying in group 0, or the node leaving the tree). A consumer keeps a set per group and cuts a prefix of h blocks
where a block of [max(0, h - cdiv(W, B)), h) is missing in group 1 (the window a query after h reads), as the
manager's match does; a consumer that ignores ``group`` over-counts hits on a hybrid replica, never under-counts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Literal

import msgspec

from radix.hashing import BlockHash

Medium = Literal["device", "host"]
DEVICE: Medium = "device"
HOST: Medium = "host"


class BlockStored(msgspec.Struct, tag="kv_block_stored", forbid_unknown_fields=True, omit_defaults=True):
    """Blocks entered the radix tree's ``medium`` tier. On the device: a chain of ``block_hashes`` (parent first)
    hanging under ``parent_block_hash`` (None: the chain starts at the root). On the host: blocks written back, in
    eviction order (children before parents, not one chain; parent_block_hash None). ``block_size`` is in tokens."""

    seq: int
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    block_size: int
    medium: Medium = DEVICE
    token_ids: bytes = b""  # the blocks' tokens, packed (radix.hashing.pack_tokens); b"": not recorded
    block_parents: list[BlockHash | None] = []  # host tier, with token_ids: each block's parent (None: a root)
    salts: list[str | None] = []  # with token_ids: per block, the cache_salt of a salted root it hangs under directly
    group: int = 0  # the KV cache group: 0 full attention, 1 the sliding-window group (module docstring)
    sliding_window: int = 0  # group 1: its window W in tokens


class BlockRemoved(msgspec.Struct, tag="kv_block_removed", forbid_unknown_fields=True):
    """Blocks left the radix tree's ``medium`` tier (evicted, dropped or uncached), in removal order (children before
    parents)."""

    seq: int
    block_hashes: list[BlockHash]
    medium: Medium = DEVICE
    group: int = 0  # the KV cache group (BlockStored.group)


class AllBlocksCleared(msgspec.Struct, tag="kv_all_blocks_cleared", forbid_unknown_fields=True):
    """The radix tree was emptied at once (prefix cache reset): forget every hash of this replica."""

    seq: int


class KvSnapshot(msgspec.Struct, tag="kv_snapshot", forbid_unknown_fields=True):
    """Every device-resident block hash (block_hashes) and every host-tier one (host_block_hashes; a block on both
    tiers is in both lists), after applying all events up to and including ``last_seq`` (-1: none yet). With a
    sliding-window group: the hashes of the nodes holding a window block (window_block_hashes), its window W in tokens
    (sliding_window) and the block size (block_size); 0 and [] with one group."""

    last_seq: int
    block_hashes: list[BlockHash]
    host_block_hashes: list[BlockHash] = []
    window_block_hashes: list[BlockHash] = []
    sliding_window: int = 0
    block_size: int = 0


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


DEFAULT_EVENT_CAPACITY = 65536
"""Events a KvEventLog holds between drains; older ones are dropped. An event costs ~100 bytes + ~57 per block hash
(measured: 563 bytes for the 12-block chains of 200-token prompts), so a full ring of such events holds ~37 MB; a log
that keeps token ids adds 4 bytes per token (64 per block of 16)."""


class KvEventLog:
    """Collects KV events in order, numbering them 0, 1, 2, ...; the owner drains them.

    A bounded ring: when ``capacity`` events wait undrained, recording one more drops the oldest (its number stays
    used, so the consumer finds the gap with find_gap and resyncs from a snapshot) and counts it in ``num_dropped``.
    Mutates only itself; O(1) per event. ``enabled=False`` records nothing (numbers are then not consumed);
    ``token_ids=True`` keeps the stored blocks' packed tokens in each BlockStored (O(tokens) bytes, joined in C).

    Raises:
        ValueError: capacity < 1.
    """

    def __init__(self, enabled: bool = True, capacity: int = DEFAULT_EVENT_CAPACITY, token_ids: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.enabled = enabled
        self.token_ids = token_ids
        self.capacity = capacity
        self.num_dropped = 0
        self._events: deque[KvEvent] = deque(maxlen=capacity)
        self._next_seq = 0

    @property
    def last_seq(self) -> int:
        """Sequence number of the last event emitted (-1 before the first)."""
        return self._next_seq - 1

    def __len__(self) -> int:
        """Events waiting to be drained (<= capacity)."""
        return len(self._events)

    def _append(self, event: KvEvent) -> None:
        if len(self._events) == self.capacity:
            self.num_dropped += 1  # the deque drops its oldest on append
        self._events.append(event)
        self._next_seq += 1

    def stored(
        self,
        block_hashes: list[BlockHash],
        parent_block_hash: BlockHash | None,
        block_size: int,
        medium: Medium = DEVICE,
        keys: Sequence[bytes] = (),
        block_parents: Sequence[BlockHash | None] = (),
        salts: Sequence[str | None] = (),
        group: int = 0,
        sliding_window: int = 0,
    ) -> None:
        """Record a BlockStored event (no event for an empty list). keys: each block's packed tokens (the tree's
        child keys, in block_hashes order); block_parents: each block's parent hash (host-tier write-backs, group 1);
        salts: each block's salt (radix.node.salt_under its parent); all kept when the log was made with
        token_ids=True. group, sliding_window: BlockStored's."""
        if self.enabled and block_hashes:
            event = BlockStored(self._next_seq, block_hashes, parent_block_hash, block_size, medium)
            event.group = group
            event.sliding_window = sliding_window
            if self.token_ids:
                event.token_ids = b"".join(keys)
                event.block_parents = list(block_parents)
                event.salts = list(salts)
            self._append(event)

    def removed(self, block_hashes: list[BlockHash], medium: Medium = DEVICE, group: int = 0) -> None:
        """Record a BlockRemoved event (no event for an empty list)."""
        if self.enabled and block_hashes:
            self._append(BlockRemoved(self._next_seq, block_hashes, medium, group))

    def cleared(self) -> None:
        """Record an AllBlocksCleared event."""
        if self.enabled:
            self._append(AllBlocksCleared(self._next_seq))

    def drain(self) -> list[KvEvent]:
        """Return the events collected since the last drain, oldest first, and forget them. When events were dropped
        since the previous drain, the first seq returned is past the previous drain's last + 1 (a gap)."""
        events = list(self._events)
        self._events.clear()
        return events


def find_gap(last_seen_seq: int, events: Sequence[KvEvent]) -> int | None:
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
