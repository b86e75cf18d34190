"""TreeNodes: the radix tree's nodes, their indexes and the device LRU, with the structural steps on them (a node takes
or gives up a device block, a node leaves the tree) that the RadixTree (radix/tree.py) and its TierMoves part
(radix/tier_moves.py) share. Both get this one object in their constructors and read and update it in place; the
tree's invariant check (radix/invariants.py check_tree) recounts it.

Indexes: ``roots`` (one Root per cache_salt; an empty salted root is dropped with its last child), ``by_hash`` (hash
-> node, every node of either tier) and ``by_block`` (device block id -> node, None for a block the tree does not
hold). ``lru``: the evictable device leaves (ref count 1, no device-resident child) in a
``sortedcontainers.SortedList`` keyed by ``last_access << 32 | block_id``, where last_access is ``clock``, a logical
clock bumped per unlock / insert / load call (tick), so the least recently used leaf is ``lru[0]``.
``num_evictable``: device blocks whose only reference is the tree's. ``num_device``: device-resident nodes.

The moves of the current call (blocks that left the device, written back to the host tier, or left the host tier) are
collected in ``removed`` / ``host_stored`` / ``host_removed`` and emitted together at its end (emit_moves), in a fixed
order (radix/events.py).
"""

from __future__ import annotations

from collections.abc import Callable

from sortedcontainers import SortedList

from radix.block_pool import BlockPool
from radix.events import HOST, KvEventLog
from radix.hashing import BlockHash
from radix.host_tier import HostTier
from radix.node import Node, Root, salt_under


class TreeNodes:
    """The nodes and indexes of one RadixTree (see the module docstring).

    Args:
        pool: the device BlockPool whose blocks the nodes hold (``by_block`` has one entry per block).
        block_size: tokens per block (for the events).
        events: where the moves go (emit_moves, clear).
        host: the host tier whose copies nodes may hold (None: every node is on the device).
    Mutates only itself, the nodes, the pool's ref counts and free queue, the host tier and the event log.
    """

    def __init__(self, pool: BlockPool, block_size: int, events: KvEventLog, host: HostTier | None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.events = events
        self.host = host
        self.epoch = 0
        self.roots: dict[str | None, Root] = {None: Root(None)}
        self.by_hash: dict[BlockHash, Node] = {}
        self.by_block: list[Node | None] = [None] * pool.num_blocks
        self.lru: SortedList = SortedList()
        self.clock = 0
        self.num_evictable = 0
        self.num_device = 0
        self.removed: list[BlockHash] = []  # left the device in the current call
        self.host_stored: list[Node] = []  # written back in the current call
        self.host_removed: list[BlockHash] = []  # left the host tier in the current call
        self.on_forget: Callable[[Node], None] | None = None  # told of each node leaving (a window group's hook)

    def tick(self) -> int:
        """Advance the logical clock; returns the new time. O(1)."""
        self.clock += 1
        return self.clock

    def root(self, salt: str | None) -> Root:
        """The root of salt's subtree, made (empty) if it has none. O(1)."""
        root = self.roots.get(salt)
        if root is None:
            root = Root(salt)
            self.roots[salt] = root
        return root

    # ----------------------------------------------------------------- device blocks
    def take_device_block(self, node: Node, block_id: int, lru_key: int) -> None:
        """node (new, or on the host only) gets block_id (held by the caller, checked: allocated, not cached) as its
        device copy with the tree's reference (ref count >= 2, so not idle); its parent gains a device child.
        O(log n)."""
        self.pool.ref_counts[block_id] += 1
        node.block_id = block_id
        node.lru_key = lru_key
        self.by_block[block_id] = node
        self.num_device += 1
        self.gain_device_child(node.parent)
        if node.host_block >= 0 and self.host is not None:
            self.host.refresh(node)  # on both tiers now: its host copy may be dropped

    def replace_idle(self, node: Node, block_id: int, lru_key: int) -> None:
        """node's idle block (ref count 1) leaves for the free queue; block_id (held by the caller, not cached) takes
        its place with the tree's reference. Bumps epoch: a match naming the old block is stale. O(log n).

        Raises ValueError: block_id is free or already cached (nothing changed)."""
        rcs = self.pool.ref_counts
        by_block = self.by_block
        old = node.block_id
        if rcs[block_id] == 0 or by_block[block_id] is not None:
            raise ValueError(f"block {block_id} is free or already cached")
        if node.num_device_children == 0:
            self.lru.remove(node.lru_key)
        self.num_evictable -= 1
        by_block[old] = None
        by_block[block_id] = node
        node.block_id = block_id
        node.lru_key = lru_key
        rcs[block_id] += 1  # >= 2: the caller's reference and the tree's
        self.pool.decref(old)
        self.epoch += 1

    def gain_device_child(self, parent: Node | None) -> None:
        """parent (device-resident or a root) gets one more device-resident child: no device leaf any more. O(log n)."""
        assert parent is not None
        if type(parent) is not Root and parent.num_device_children == 0 and self.pool.ref_counts[parent.block_id] == 1:
            self.lru.remove(parent.lru_key)  # an idle device leaf no more
        parent.num_device_children += 1

    def lose_device_child(self, parent: Node, lru: SortedList | None) -> Node | None:
        """parent lost a device-resident child. Left an idle device leaf, it joins the LRU list, or, given lru and
        when it would be its first entry, is returned instead (the caller evicts it next). O(log n)."""
        parent.num_device_children -= 1
        if type(parent) is Root or parent.num_device_children or self.pool.ref_counts[parent.block_id] != 1:
            return None
        if lru is not None and (not lru or parent.lru_key < lru[0]):
            return parent
        self.lru.add(parent.lru_key)
        return None

    # ----------------------------------------------------------------- leaving the tree
    def forget_child(self, node: Node) -> None:
        """Remove node from its parent's children; an empty salted root goes, a host-only parent left childless
        becomes a host leaf (droppable). O(log n)."""
        parent = node.parent
        assert parent is not None and parent.children is not None
        children = parent.children
        del children[node.key]
        if self.on_forget is not None:
            self.on_forget(node)
        if children:
            return
        parent.children = None
        if type(parent) is Root:
            if parent.salt is not None:
                del self.roots[parent.salt]
        elif parent.block_id < 0 and self.host is not None:
            self.host.refresh(parent)

    def unlink(self, node: Node, lru: SortedList | None) -> Node | None:
        """Take a device-resident node with no children out of the tree (its device block keeps the tree's
        reference: the caller drops it; a host copy is dropped here). Returns what lose_device_child returns.
        O(log n)."""
        h = node.block_hash
        assert h is not None and node.children is None
        del self.by_hash[h]
        self.by_block[node.block_id] = None
        self.num_device -= 1
        self.removed.append(h)
        if node.host_block >= 0 and self.host is not None:
            self.host.detach(node)
            self.host_removed.append(h)
        self.forget_child(node)
        assert node.parent is not None
        return self.lose_device_child(node.parent, lru)

    def unlink_host_only(self, node: Node) -> None:
        """Take a host-only node with no children out of the tree; its host block loses the tree's reference.
        O(log n)."""
        h = node.block_hash
        assert h is not None and node.children is None and node.block_id < 0 and self.host is not None
        del self.by_hash[h]
        self.host.detach(node)
        self.host_removed.append(h)
        self.forget_child(node)

    def emit_moves(self) -> None:
        """Emit the current call's write-backs (BlockStored, host), device removals, host removals, in that order,
        and start the next call's lists. O(moves)."""
        stored = self.host_stored
        removed = self.removed
        host_removed = self.host_removed
        self.host_stored = []
        self.removed = []
        self.host_removed = []
        hashes: list[BlockHash] = []
        for node in stored:
            assert node.block_hash is not None and node.parent is not None  # a block node, never a root
            hashes.append(node.block_hash)
        keys = [node.key for node in stored]
        parents = [node.parent.block_hash for node in stored if node.parent is not None]
        salts = [salt_under(node.parent) for node in stored]
        self.events.stored(hashes, None, self.block_size, HOST, keys, parents, salts)
        self.events.removed(removed)
        self.events.removed(host_removed, HOST)

    def clear(self) -> bool:
        """Drop every node of both tiers at once if every device block is evictable and no host block is pinned by a
        pending copy (emits AllBlocksCleared, bumps epoch); else change nothing and return False. O(nodes)."""
        host = self.host
        if self.num_evictable != self.num_device or (host is not None and host.num_pinned):
            return False
        for node in self.by_hash.values():
            if self.on_forget is not None:
                self.on_forget(node)
            if node.block_id >= 0:
                self.by_block[node.block_id] = None
                self.pool.decref(node.block_id)
            if host is not None and node.host_block >= 0:
                host.detach(node)
        self.by_hash.clear()
        self.roots = {None: Root(None)}
        self.lru.clear()
        self.num_evictable = 0
        self.num_device = 0
        self.epoch += 1
        self.events.cleared()
        return True
