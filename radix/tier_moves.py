"""TierMoves: how blocks leave the radix tree's device tier and come back (the base of RadixTree, radix/tree.py).

Device eviction takes the least recently used evictable device leaf (ref count 1, no device-resident child) first.
Without a host tier the node leaves the tree (as before the tier existed). With one (write back on eviction,
SGLang's HiCache / HiRadixTree, Zheng et al. 2024, keeps evicted KV in host memory the same way):
  - a node already on the host just loses its device block;
  - otherwise a host block is found (a free one, else the host LRU's victim is dropped: a redundant copy of a
    device-resident node, or a host-only leaf, which leaves the tree), the (device, host) copy is scheduled and pinned
    (radix/host_tier.py) and the node stays, host-only;
  - when no host block can be had (every one pinned by a pending copy), the node leaves the tree with the host-only
    subtree under it, so admission never waits on the host tier.
The device block is free at once: the worker copies a step's write-backs before anything of that step writes a
device block (ForwardBatch.swap_out is applied first), so the block may be handed out again in the same step.

Load-back (load_back) gives a matched host-only chain device blocks, schedules the host -> device copies and pins
their host blocks; the blocks are ``loading`` until the step's copies are done (HostTier.copies_done).

This module holds the structural steps shared with RadixTree (unlinking nodes, device-child counts, events of the
current call); the attributes it declares are set by RadixTree.__init__.
"""

from __future__ import annotations

from collections.abc import Sequence

from sortedcontainers import SortedList

from radix.block_pool import BlockPool
from radix.events import HOST, KvEventLog
from radix.hashing import BlockHash
from radix.host_tier import HostTier
from radix.node import ID_BITS, ID_MASK, NOT_RESIDENT, Node, Root


class TierMoves:
    """Eviction, write-back, load-back and node removal over RadixTree's state (see the module docstring)."""

    pool: BlockPool
    host: HostTier | None
    events: KvEventLog
    block_size: int
    epoch: int
    _roots: dict[str | None, Root]
    _nodes: dict[BlockHash, Node]
    _by_block: list[Node | None]
    _lru: SortedList
    _clock: int
    _num_evictable: int
    _num_device: int
    _removed: list[BlockHash]
    _host_stored: list[BlockHash]
    _host_removed: list[BlockHash]

    # ----------------------------------------------------------------- device eviction
    def evict(self, n: int) -> list[int]:
        """Free up to ``n`` evictable device blocks, least recently used device leaf first; a parent whose last
        device child goes becomes a device leaf and competes by its own last access. Each node is written back to
        the host tier, or dropped (module docstring). Returns the freed block ids in eviction order (now on the
        pool's free queue). Emits BlockStored (host) for the write-backs, BlockRemoved (device) for every freed
        block and BlockRemoved (host) for what left the host tier; bumps epoch if anything went. O(n log N), no scan:
        a parent that is the next victim anyway (its last access older than every other idle leaf's, e.g. the rest
        of a chain released at once) is taken directly, without entering the LRU list."""
        freed: list[int] = []
        lru, by_block = self._lru, self._by_block
        node: Node | None = None
        while len(freed) < n:
            if node is None:
                if not lru:
                    break
                node = by_block[lru.pop(0) & ID_MASK]
                assert node is not None
            freed.append(node.block_id)
            node = self._leave_device(node, lru)
        if node is not None:  # a parent taken out of turn but not needed: back to the LRU list
            lru.add(node.lru_key)
        if freed:
            self._num_evictable -= len(freed)
            self.pool.release_last(freed)
            self.epoch += 1
            self._emit_moves()
        return freed

    def _leave_device(self, node: Node, lru: SortedList) -> Node | None:
        """node (an evictable device leaf, out of the LRU list) leaves the device: kept host-only, or unlinked with
        its host-only subtree. Its block keeps the tree's reference (evict releases it). Returns its parent when
        that is the next victim anyway."""
        host = self.host
        if host is None:
            return self._unlink(node, lru)
        if node.host_block < 0:
            host_block = self._host_slot()
            if host_block is None:
                self._drop_subtree(node)
                return self._unlink(node, lru)
            host.write_back(node, host_block)
            assert node.block_hash is not None
            self._host_stored.append(node.block_hash)
        assert node.block_hash is not None
        self._by_block[node.block_id] = None
        node.block_id = NOT_RESIDENT
        self._num_device -= 1
        self._removed.append(node.block_hash)
        host.refresh(node)  # host-only now: droppable only as an unpinned leaf
        assert node.parent is not None
        return self._lose_device_child(node.parent, lru)

    def _host_slot(self) -> int | None:
        """A host block for a write-back: a free one, else the host LRU victim's (its copy dropped; a host-only
        victim leaves the tree). None when every host block is pinned. O(log n)."""
        host = self.host
        assert host is not None
        block = host.allocate()
        if block is not None:
            return block
        victim = host.pop_victim()
        if victim is None:
            return None
        if victim.block_id >= 0:
            assert victim.block_hash is not None
            host.detach(victim)
            self._host_removed.append(victim.block_hash)
        else:
            self._unlink_host_only(victim)
        return host.allocate()

    def _drop_subtree(self, node: Node) -> None:
        """Unlink every descendant of node (all host-only: node is a device leaf), deepest first, then by host block
        (children before parents; a fixed order, so the host free queue's order is predictable). O(k log k) for k
        descendants."""
        found: list[tuple[int, int, Node]] = []
        stack = [(child, 1) for child in (node.children or {}).values()]
        while stack:
            child, depth = stack.pop()
            found.append((-depth, child.host_block, child))
            stack.extend((grandchild, depth + 1) for grandchild in (child.children or {}).values())
        for _, _, child in sorted(found, key=lambda t: (t[0], t[1])):
            self._unlink_host_only(child)

    # ----------------------------------------------------------------- load-back
    def pin_for_load(self, nodes: Sequence[Node]) -> None:
        """Pin the host copies of a matched host-only chain before the device blocks for it are taken (the eviction
        that frees them must not drop these copies). Follow with load_back in the same step. O(len * log n).

        Raises ValueError: a node is on the device or has no host copy (a stale match)."""
        host = self.host
        for node in nodes:
            if host is None or node.block_id >= 0 or node.host_block < 0:
                raise ValueError("load of a node that is not host-only")
            host.pin(node)

    def load_back(self, nodes: Sequence[Node], device_blocks: Sequence[int]) -> None:
        """Give each pinned host-only node of a matched chain (parent first, hanging under a device-resident node or
        a root) its device block (allocated, ref count 1: the caller's reference; the tree adds its own) and schedule
        the host -> device copies. The nodes are on both tiers from now on, the blocks ``loading`` until the step's
        copies are done. Emits one BlockStored (device) for the chain; bumps epoch. O(len * log n).

        Raises ValueError: lengths differ, or a device block is free or already cached (nothing changed)."""
        host, rcs, by_block = self.host, self.pool.ref_counts, self._by_block
        if len(nodes) != len(device_blocks) or any(rcs[d] == 0 or by_block[d] is not None for d in device_blocks):
            raise ValueError(f"load_back of {len(nodes)} nodes into blocks {list(device_blocks)}")
        if not nodes:
            return
        assert host is not None
        tick = self._tick()
        stored: list[BlockHash] = []
        for node, block in zip(nodes, device_blocks, strict=True):
            rcs[block] += 1  # the tree's reference beside the caller's
            node.block_id, node.lru_key = block, tick << ID_BITS | block
            by_block[block] = node
            self._num_device += 1
            self._gain_device_child(node.parent)
            host.load_back(node, block, tick)
            assert node.block_hash is not None
            stored.append(node.block_hash)
        self.epoch += 1
        parent = nodes[0].parent
        self.events.stored(stored, None if parent is None else parent.block_hash, self.block_size)

    # ----------------------------------------------------------------- structure
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _gain_device_child(self, parent: Node | None) -> None:
        """parent (device-resident or a root) gets one more device-resident child: no device leaf any more."""
        assert parent is not None
        if type(parent) is not Root and parent.num_device_children == 0 and self.pool.ref_counts[parent.block_id] == 1:
            self._lru.remove(parent.lru_key)  # an idle device leaf no more
        parent.num_device_children += 1

    def _lose_device_child(self, parent: Node, lru: SortedList | None) -> Node | None:
        """parent lost a device-resident child. Left an idle device leaf, it joins the LRU list, or, given lru and
        when it would be its first entry, is returned instead (the caller evicts it next)."""
        parent.num_device_children -= 1
        if type(parent) is Root or parent.num_device_children or self.pool.ref_counts[parent.block_id] != 1:
            return None
        if lru is not None and (not lru or parent.lru_key < lru[0]):
            return parent
        self._lru.add(parent.lru_key)
        return None

    def _forget_child(self, node: Node) -> None:
        """Remove node from its parent's children; an empty salted root goes, a host-only parent left childless
        becomes a host leaf (droppable)."""
        parent = node.parent
        assert parent is not None and parent.children is not None
        children = parent.children
        del children[node.key]
        if children:
            return
        parent.children = None
        if type(parent) is Root:
            if parent.salt is not None:
                del self._roots[parent.salt]
        elif parent.block_id < 0 and self.host is not None:
            self.host.refresh(parent)

    def _unlink(self, node: Node, lru: SortedList | None) -> Node | None:
        """Take a device-resident node with no children out of the tree (its device block keeps the tree's
        reference: the caller drops it; a host copy is dropped here). Returns what _lose_device_child returns."""
        h = node.block_hash
        assert h is not None and node.children is None
        del self._nodes[h]
        self._by_block[node.block_id] = None
        self._num_device -= 1
        self._removed.append(h)
        if node.host_block >= 0 and self.host is not None:
            self.host.detach(node)
            self._host_removed.append(h)
        self._forget_child(node)
        assert node.parent is not None
        return self._lose_device_child(node.parent, lru)

    def _unlink_host_only(self, node: Node) -> None:
        """Take a host-only node with no children out of the tree; its host block loses the tree's reference."""
        h = node.block_hash
        assert h is not None and node.children is None and node.block_id < 0 and self.host is not None
        del self._nodes[h]
        self.host.detach(node)
        self._host_removed.append(h)
        self._forget_child(node)

    def _emit_moves(self) -> None:
        """Emit the current call's write-backs (BlockStored, host), device removals, host removals, in that order."""
        stored, removed, host_removed = self._host_stored, self._removed, self._host_removed
        self._host_stored, self._removed, self._host_removed = [], [], []
        self.events.stored(stored, None, self.block_size, HOST)
        self.events.removed(removed)
        self.events.removed(host_removed, HOST)
