"""TierMoves: how blocks leave the radix tree's device tier and come back (a part RadixTree owns, radix/tree.py).

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

It works on the tree's TreeNodes (radix/tree_nodes.py), given to its constructor: the structural steps (unlinking
nodes, device-child counts, the moves of the current call) are that object's.
"""

from __future__ import annotations

from collections.abc import Sequence

from sortedcontainers import SortedList

from radix.hashing import BlockHash
from radix.node import ID_BITS, ID_MASK, NOT_RESIDENT, Node, salt_under
from radix.tree_nodes import TreeNodes


class TierMoves:
    """Eviction, write-back and load-back over one tree's nodes (see the module docstring).

    Args:
        nodes: the tree's nodes and indexes; its host tier (nodes.host, None: eviction drops) is the one used here.
    Mutates nodes, the device pool, the host tier and the event log.
    """

    def __init__(self, nodes: TreeNodes) -> None:
        self.nodes = nodes

    # ----------------------------------------------------------------- device eviction
    def evict(self, n: int) -> list[int]:
        """Free up to ``n`` evictable device blocks, least recently used device leaf first; a parent whose last
        device child goes becomes a device leaf and competes by its own last access. Each node is written back to
        the host tier, or dropped (module docstring). Returns the freed block ids in eviction order (now on the
        pool's free queue). Emits BlockStored (host) for the write-backs, BlockRemoved (device) for every freed
        block and BlockRemoved (host) for what left the host tier; bumps epoch if anything went. O(n log N), no scan:
        a parent that is the next victim anyway (its last access older than every other idle leaf's, e.g. the rest
        of a chain released at once) is taken directly, without entering the LRU list."""
        nodes = self.nodes
        freed: list[int] = []
        lru = nodes.lru
        by_block = nodes.by_block
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
            nodes.num_evictable -= len(freed)
            nodes.pool.release_last(freed)
            nodes.epoch += 1
            nodes.emit_moves()
        return freed

    def _leave_device(self, node: Node, lru: SortedList) -> Node | None:
        """node (an evictable device leaf, out of the LRU list) leaves the device: kept host-only, or unlinked with
        its host-only subtree. Its block keeps the tree's reference (evict releases it). Returns its parent when
        that is the next victim anyway."""
        nodes = self.nodes
        host = nodes.host
        if host is None:
            return nodes.unlink(node, lru)
        if node.host_block < 0:
            host_block = self._host_slot()
            if host_block is None:
                self._drop_subtree(node)
                return nodes.unlink(node, lru)
            host.write_back(node, host_block)
            nodes.host_stored.append(node)
        assert node.block_hash is not None
        nodes.by_block[node.block_id] = None
        node.block_id = NOT_RESIDENT
        nodes.num_device -= 1
        nodes.removed.append(node.block_hash)
        host.refresh(node)  # host-only now: droppable only as an unpinned leaf
        assert node.parent is not None
        return nodes.lose_device_child(node.parent, lru)

    def _host_slot(self) -> int | None:
        """A host block for a write-back: a free one, else the host LRU victim's (its copy dropped; a host-only
        victim leaves the tree). None when every host block is pinned. O(log n)."""
        host = self.nodes.host
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
            self.nodes.host_removed.append(victim.block_hash)
        else:
            self.nodes.unlink_host_only(victim)
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
            self.nodes.unlink_host_only(child)

    # ----------------------------------------------------------------- load-back
    def pin_for_load(self, chain: Sequence[Node]) -> None:
        """Pin the host copies of a matched host-only chain before the device blocks for it are taken (the eviction
        that frees them must not drop these copies). Follow with load_back in the same step. O(len * log n).

        Raises ValueError: a node is on the device or has no host copy (a stale match)."""
        host = self.nodes.host
        for node in chain:
            if host is None or node.block_id >= 0 or node.host_block < 0:
                raise ValueError("load of a node that is not host-only")
            host.pin(node)

    def load_back(self, chain: Sequence[Node], device_blocks: Sequence[int]) -> None:
        """Give each pinned host-only node of a matched chain (parent first, hanging under a device-resident node or
        a root) its device block (allocated, ref count 1: the caller's reference; the tree adds its own) and schedule
        the host -> device copies. The nodes are on both tiers from now on, the blocks ``loading`` until the step's
        copies are done. Emits one BlockStored (device) for the chain; bumps epoch. O(len * log n).

        Raises ValueError: lengths differ, or a device block is free or already cached (nothing changed)."""
        nodes = self.nodes
        host = nodes.host
        rcs = nodes.pool.ref_counts
        by_block = nodes.by_block
        if len(chain) != len(device_blocks) or any(rcs[d] == 0 or by_block[d] is not None for d in device_blocks):
            raise ValueError(f"load_back of {len(chain)} nodes into blocks {list(device_blocks)}")
        if not chain:
            return
        assert host is not None
        tick = nodes.tick()
        stored: list[BlockHash] = []
        keys: list[bytes] = []
        for node, block in zip(chain, device_blocks, strict=True):
            rcs[block] += 1  # the tree's reference beside the caller's
            node.block_id = block
            node.lru_key = tick << ID_BITS | block
            by_block[block] = node
            nodes.num_device += 1
            nodes.gain_device_child(node.parent)
            host.load_back(node, block, tick)
            assert node.block_hash is not None
            stored.append(node.block_hash)
            keys.append(node.key)
        nodes.epoch += 1
        parent = chain[0].parent
        salts = [salt_under(parent)] + [None] * (len(stored) - 1)
        parent_hash = None if parent is None else parent.block_hash
        nodes.events.stored(stored, parent_hash, nodes.block_size, keys=keys, salts=salts)
