"""HostTier: the host-memory tier of the radix tree (the KV that left the device pool and may come back).

Block states. A host block is free (ref count 0), holds one node's host copy (ref 1: the tree's reference), or is
pinned by pending copies (one more reference each): a write-back into it and / or a load-back out of it, scheduled in
the step being planned or in flight (a block written back and loaded back in the same step is right: the worker
applies a step's write-backs before its loads). A pinned block is never freed, overwritten or dropped; it is
unpinned by copies_done, which the scheduler calls when that step's ForwardResult arrives (the worker applies a
step's copies before its forward, so they are done by then). A node that leaves the tree while its block is pinned
leaves the block held by its pins until then. Invariant (radix/invariants.py): free + evictable + in_use == total,
each block counted once, where in_use = pinned and evictable = held by a node and unpinned.

Host LRU: the host copies that can be dropped right now, least recently used first, in a
``sortedcontainers.SortedList`` keyed by ``host_lru_key`` (last access << 32 | host block): an unpinned copy whose
node is device-resident too (the copy is redundant while the device one lives) or is a leaf of the tree (a host-only
node with no children, so dropping it takes it out of the tree leaves first). O(log n) per change, no scan.

The step's copies: write_back (device, host) pairs and load_back (host, device) pairs, in the order scheduled; the
scheduler takes them into its ForwardBatch (take_copies: host ids offset into the worker's host KV tensor, after the
swap pool's). ``loading``: device blocks whose load-back is pending; attention must not read them until copies_done
(the scheduler holds a request whose prefix has one out of the step's forward). ``device_pins``: one device reference
per block of each pending load's path (the matched device prefix and the loaded blocks; the KVCacheManager takes and
releases them): so none of them is freed, evicted or written back before its copy lands, even when the request that
asked for the load lets go first (an abort), and the path property (radix/tree.py) holds meanwhile.
"""

from __future__ import annotations

from typing import NamedTuple

from sortedcontainers import SortedList

from radix.block_pool import BlockPool
from radix.node import ID_BITS, NOT_RESIDENT, Node


class TierCopies(NamedTuple):
    """The copies one step needs between the tiers, as worker host ids (host tier block + the swap pool's size).

    write_back: (device block, host block) pairs, copied device -> host before anything overwrites the device block
        (the ForwardBatch's swap_out, applied first). load_back: (host block, device block) pairs, copied host ->
        device before the forward (the ForwardBatch's swap_in).
    """

    write_back: list[tuple[int, int]]
    load_back: list[tuple[int, int]]


class HostTier:
    """Host blocks, their LRU, the pending copies and their pins (see the module docstring).

    Args:
        num_blocks: host-tier blocks (ids 0 .. num_blocks - 1), >= 1.
    Mutates only itself and the host fields of the nodes it is given (host_block, host_lru_key, host_listed).
    Raises ValueError for num_blocks < 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host tier needs >= 1 block, got {num_blocks}")
        self.pool = BlockPool(num_blocks, reserve_null=False)
        self.by_block: list[Node | None] = [None] * num_blocks
        self.lru: SortedList = SortedList()
        self.loading: set[int] = set()
        self.device_pins: list[int] = []
        self.num_cached = 0  # nodes holding a host copy
        self.num_written_back = 0  # blocks copied device -> host since the start
        self.num_loaded_back = 0  # blocks copied host -> device since the start
        self._pins: dict[int, int] = {}  # host block -> pending copies, in first-pin order
        self._write_back: list[tuple[int, int]] = []
        self._load_back: list[tuple[int, int]] = []

    # ----------------------------------------------------------------- counts
    @property
    def num_pinned(self) -> int:
        """Host blocks pinned by a pending copy (the tier's in-use blocks)."""
        return len(self._pins)

    @property
    def num_evictable(self) -> int:
        """Host copies held by a node and not pinned (reclaimable, leaves first). O(1)."""
        return self.pool.num_blocks - self.pool.num_free - len(self._pins)

    def pins(self) -> dict[int, int]:
        """Pinned host blocks -> their pending copies, in first-pin order (for invariant checks)."""
        return dict(self._pins)

    # ----------------------------------------------------------------- host copies
    def is_candidate(self, node: Node) -> bool:
        """Whether node's host copy can be dropped now (unpinned; device-resident too, or a leaf). O(1)."""
        hb = node.host_block
        return hb >= 0 and self.pool.ref_counts[hb] == 1 and (node.block_id >= 0 or node.children is None)

    def refresh(self, node: Node) -> None:
        """Put node into / take it out of the host LRU as is_candidate says. O(log n)."""
        want = self.is_candidate(node)
        if want != node.host_listed:
            if want:
                self.lru.add(node.host_lru_key)
            else:
                self.lru.remove(node.host_lru_key)
            node.host_listed = want

    def allocate(self) -> int | None:
        """A free host block (ref count 1, for the caller to attach), or None when none is free. O(1)."""
        return self.pool.allocate(1)[0] if self.pool.num_free else None

    def pop_victim(self) -> Node | None:
        """The least recently used droppable host copy's node, taken out of the LRU (the caller detaches it), or
        None when no copy can be dropped. O(log n)."""
        if not self.lru:
            return None
        node = self.by_block[self.lru.pop(0) & ((1 << ID_BITS) - 1)]
        assert node is not None
        node.host_listed = False
        return node

    def detach(self, node: Node) -> None:
        """Drop node's host copy: its block loses the tree's reference (free now, or at copies_done when pinned).
        O(log n)."""
        hb = node.host_block
        if node.host_listed:
            self.lru.remove(node.host_lru_key)
            node.host_listed = False
        self.by_block[hb] = None
        node.host_block = NOT_RESIDENT
        self.num_cached -= 1
        self.pool.decref(hb)

    def write_back(self, node: Node, host_block: int) -> None:
        """node's device block is being evicted: host_block (allocated, ref 1) becomes its host copy, pinned, and the
        (device, host) copy is scheduled. node keeps its device block id until the caller drops it. O(1)."""
        self.by_block[host_block] = node
        node.host_block = host_block
        node.host_lru_key = (node.lru_key >> ID_BITS) << ID_BITS | host_block  # its last use on the device
        self.num_cached += 1
        self._pin(host_block)
        self._write_back.append((node.block_id, host_block))
        self.num_written_back += 1

    def pin(self, node: Node) -> None:
        """Pin node's host copy for a load-back (out of the LRU until copies_done). O(log n)."""
        if node.host_listed:
            self.lru.remove(node.host_lru_key)
            node.host_listed = False
        self._pin(node.host_block)

    def load_back(self, node: Node, device_block: int, tick: int) -> None:
        """Schedule the copy of node's pinned host block into device_block; device_block is loading until
        copies_done. The host copy stays (the node is on both tiers), last accessed at tick. O(1).

        Raises AssertionError: node's host copy is not pinned (call pin first)."""
        hb = node.host_block
        assert hb in self._pins and not node.host_listed, f"load of unpinned host block {hb}"
        node.host_lru_key = tick << ID_BITS | hb
        self._load_back.append((hb, device_block))
        self.loading.add(device_block)
        self.num_loaded_back += 1

    def _pin(self, host_block: int) -> None:
        self.pool.incref(host_block)
        self._pins[host_block] = self._pins.get(host_block, 0) + 1

    # ----------------------------------------------------------------- the step's copies
    def take_copies(self, host_offset: int) -> TierCopies:
        """The copies scheduled since the last take, host ids + host_offset (the worker's host tensor holds the swap
        pool first); they stay pinned until copies_done. O(copies)."""
        wb = [(d, h + host_offset) for d, h in self._write_back]
        lb = [(h + host_offset, d) for h, d in self._load_back]
        self._write_back = []
        self._load_back = []
        return TierCopies(wb, lb)

    def copies_done(self) -> None:
        """The worker applied every copy taken so far: unpin their blocks (a block whose node left the tree is freed
        now; a held one may enter the host LRU) and clear ``loading``. O(pinned * log n).

        Raises AssertionError when copies were scheduled but not taken (they would be lost).
        """
        assert not self._write_back and not self._load_back, "copies_done before the step's copies were taken"
        by_block = self.by_block
        rcs = self.pool.ref_counts
        for hb, count in self._pins.items():
            for _ in range(count):
                self.pool.decref(hb)
            node = by_block[hb]
            if node is not None and rcs[hb] == 1:
                self.refresh(node)
        self._pins = {}
        self.loading.clear()
