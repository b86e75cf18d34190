"""Radix tree of full KV blocks: match by tokens, insert (de-duplicating), lock/unlock, uncache, clear; its eviction
and the moves between the device and host tiers are radix/tier_moves.py (TierMoves, a base of RadixTree).

Shape: one node per block (radix/node.py). A node's children are a dict keyed by the child block's packed tokens
(radix/keys.py): a match walks the prompt block by block with one dict probe each (exact comparison, Python's native
bytes hashing; no cryptographic hash, no token-by-token loop, no split/merge code: a block is the unit of sharing,
locking and eviction anyway, so per-block nodes make ref counting and leaf eviction exact). Each cache_salt has its
own root, so tenants never share a block; an empty salted root is dropped with its last child.

Naming: when a block first enters the tree it gets its chained content hash (radix/hashing.py: BLAKE2b over the parent
hash, the tokens and, on the first block, the salt), computed exactly once. The hash names the block in KV events and
snapshots on either tier (a second index, hash -> node, answers resident_block / host_block). A new block whose hash
is already taken by another node (a collision: never seen with BLAKE2b-128, forced in tests with a weak hash) is not
cached, so a hash always names exactly one block.

Tiers: a node is on the device, on the host tier (radix/host_tier.py, when the tree has one) or both, and device
residency is prefix-closed (radix/node.py). Without a host tier every node is on the device.

References: the tree holds one reference (BlockPool ref count) to each device-resident block. One whose only
reference is the tree's (ref count 1) is *evictable*; as the manager keeps every sequence referencing the whole
cached path it uses ("path property": ref count >= 2 implies the parent's is too), every evictable block can be
reclaimed by evicting device leaves (no device-resident child), children before parents. Evictable device leaves sit
in a ``sortedcontainers.SortedList`` keyed by ``last_access << 32 | block_id`` (last_access is a logical clock bumped
per unlock/insert/load call), so eviction pops the least recently used leaf in O(log n) and never scans the tree.

``epoch`` counts the calls that removed blocks from a tier or moved a node between tiers (evict, uncache, clear, an
idle duplicate replaced or a host-only node given a device block by insert_chain, load_back): a match taken at epoch
e names its blocks on the tiers it says only while the epoch is still e (radix/manager.py checks it before locking).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sortedcontainers import SortedList

from radix.block_pool import BlockPool
from radix.events import KvEventLog
from radix.hashing import BlockHash, HashFn, blake2b_128, hash_packed_block
from radix.host_tier import HostTier
from radix.node import ID_BITS, ID_MASK, NOT_RESIDENT, InsertResult, Node, Root, TreeMatch
from radix.tier_moves import TierMoves

logger = logging.getLogger(__name__)

__all__ = ["InsertResult", "Node", "RadixTree", "Root", "TreeMatch"]


class RadixTree(TierMoves):
    """Cached full blocks of ``block_size`` tokens over the physical blocks of ``pool`` (and of ``host``).

    Args:
        pool: the device BlockPool; the tree increfs a block it caches and decrefs it on eviction.
        block_size: tokens per block.
        hash_fn: block digest function (default BLAKE2b-128; tests inject a weak one).
        events: where BlockStored / BlockRemoved / AllBlocksCleared go (None: not recorded).
        host: the host tier evicted device blocks are written back to (None: eviction drops them).
    Block ids passed to any method must be the pool's (1 .. num_blocks - 1); they are not range-checked here.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        hash_fn: HashFn = blake2b_128,
        events: KvEventLog | None = None,
        host: HostTier | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.events = events if events is not None else KvEventLog(enabled=False)
        self.host = host
        self.epoch = 0
        self._roots: dict[str | None, Root] = {None: Root(None)}
        self._nodes: dict[BlockHash, Node] = {}
        self._by_block: list[Node | None] = [None] * pool.num_blocks
        self._lru: SortedList = SortedList()
        self._clock = 0
        self._num_evictable = 0
        self._num_device = 0  # device-resident nodes
        self._removed: list[BlockHash] = []  # left the device in the current call
        self._host_stored: list[BlockHash] = []  # written back in the current call
        self._host_removed: list[BlockHash] = []  # left the host tier in the current call

    # ----------------------------------------------------------------- queries
    @property
    def num_cached(self) -> int:
        """Device-resident blocks in the tree."""
        return self._num_device

    @property
    def num_nodes(self) -> int:
        """Blocks in the tree on either tier."""
        return len(self._nodes)

    @property
    def num_evictable(self) -> int:
        """Device blocks whose only reference is the tree's (reclaimable by evicting device leaves first)."""
        return self._num_evictable

    def block_hash(self, block_id: int) -> BlockHash | None:
        """Hash of a cached device block, None if the block is not cached. O(1)."""
        node = self._by_block[block_id]
        return None if node is None else node.block_hash

    def resident_block(self, block_hash: BlockHash) -> int | None:
        """Device block id cached under ``block_hash``, None if absent or on the host only. O(1)."""
        node = self._nodes.get(block_hash)
        return None if node is None or node.block_id < 0 else node.block_id

    def host_block(self, block_hash: BlockHash) -> int | None:
        """Host-tier block id holding ``block_hash``, None if it has no host copy. O(1)."""
        node = self._nodes.get(block_hash)
        return None if node is None or node.host_block < 0 else node.host_block

    def hashes(self) -> list[BlockHash]:
        """Hashes of the device-resident blocks (insertion order). O(nodes)."""
        return [h for h, node in self._nodes.items() if node.block_id >= 0]

    def host_hashes(self) -> list[BlockHash]:
        """Hashes of the blocks with a host copy (insertion order). O(nodes)."""
        return [h for h, node in self._nodes.items() if node.host_block >= 0]

    def lru_order(self) -> list[int]:
        """Evictable device leaves, next victim first (for tests). O(number of such leaves)."""
        return [key & ID_MASK for key in self._lru]

    def host_lru_order(self) -> list[int]:
        """Droppable host copies (host block ids), next victim first (for tests). [] without a host tier."""
        return [] if self.host is None else [key & ID_MASK for key in self.host.lru]

    def match(self, blocks: Sequence[bytes], salt: str | None, max_blocks: int) -> TreeMatch:
        """Longest cached prefix of ``blocks`` (packed tokens, radix/keys.py) in salt's subtree, at most max_blocks,
        on either tier: the device-resident blocks, then the host-only nodes after them.

        Pure: takes no reference, leaves the LRU order alone, hashes nothing. O(matched blocks) dict probes.
        """
        node: Node | None = self._roots.get(salt)
        block_ids: list[int] = []
        host_nodes: list[Node] = []
        if node is None:
            return TreeMatch(block_ids, None, host_nodes)
        append = block_ids.append
        for key in blocks[:max_blocks] if max_blocks < len(blocks) else blocks:
            children = node.children
            if children is None:
                break
            child = children.get(key)
            if child is None:
                break
            if child.block_id >= 0:
                append(child.block_id)
            else:
                host_nodes.append(child)  # prefix closure: every later one is host-only too
            node = child
        return TreeMatch(block_ids, node if block_ids or host_nodes else None, host_nodes)

    # ----------------------------------------------------------------- insert
    def insert_chain(
        self, parent: Node | None, salt: str | None, blocks: Sequence[bytes], block_ids: Sequence[int]
    ) -> InsertResult:
        """Insert consecutive full blocks (packed tokens ``blocks``, held in ``block_ids``) under ``parent``, a
        device-resident node the caller holds a reference to (None: the root of salt's subtree; salt is ignored
        otherwise).

        A block whose tokens are already a child is a duplicate. When the resident copy is idle (only the tree holds
        it) the tree takes the given block in its place, same node and hash, and frees the idle one (back of the free
        queue; epoch bumped, no event: the hash stays resident); when it is in use it stays and the given one is not
        inserted; when the child is on the host only, it takes the given block as its device copy (epoch bumped). A
        new block is hashed (once, here), gets a tree reference (its ref count + 1) and becomes a child of the
        previous one. Stops early (shorter ``resident``) on a hash collision. Emits one BlockStored (device) for the
        blocks new on the device. Only call once the blocks' KV is written. O(len(block_ids)) plus one hash per new
        block.

        Raises:
            ValueError: a new block id is already cached, or is free.
        """
        if parent is None:
            parent = self._roots.get(salt)
            if parent is None:
                parent = self._roots[salt] = Root(salt)
        resident: list[int] = []
        duplicates: list[int] = []
        stored: list[BlockHash] = []
        stored_parent: BlockHash | None = None
        lru_tick = self._tick() << ID_BITS
        hash_fn, nodes, by_block, rcs = self.hash_fn, self._nodes, self._by_block, self.pool.ref_counts
        for key, block_id in zip(blocks, block_ids, strict=True):
            children = parent.children
            node = None if children is None else children.get(key)
            if node is None or node.block_id < 0:
                if rcs[block_id] == 0 or by_block[block_id] is not None:
                    raise ValueError(f"block {block_id} is free or already cached")
                if node is None:
                    h = hash_packed_block(
                        parent.block_hash, key, parent.salt if type(parent) is Root else None, hash_fn
                    )
                    if h in nodes:
                        logger.debug("block hash collision at block %d; not cached", block_id)
                        break
                    node = Node(NOT_RESIDENT, h, key, parent, 0)
                    nodes[h] = node
                    if children is None:
                        parent.children = {key: node}
                    else:
                        children[key] = node
                else:
                    self.epoch += 1  # a match that named it host-only would load it back
                self._take_device_block(node, block_id, lru_tick | block_id)
                if not stored:
                    stored_parent = parent.block_hash
                assert node.block_hash is not None
                stored.append(node.block_hash)
            elif node.block_id != block_id:
                if rcs[node.block_id] == 1:
                    self._replace_idle(node, block_id, lru_tick | block_id)
                else:
                    duplicates.append(block_id)
            resident.append(node.block_id)
            parent = node
        self.events.stored(stored, stored_parent, self.block_size)
        return InsertResult(resident, duplicates, None if type(parent) is Root else parent)

    def _take_device_block(self, node: Node, block_id: int, lru_key: int) -> None:
        """node (new, or on the host only) gets block_id (held by the caller, checked: allocated, not cached) as its
        device copy with the tree's reference (ref count >= 2, so not idle); its parent gains a device child.
        O(log n)."""
        rcs, by_block = self.pool.ref_counts, self._by_block
        rcs[block_id] += 1
        node.block_id, node.lru_key = block_id, lru_key
        by_block[block_id] = node
        self._num_device += 1
        self._gain_device_child(node.parent)
        if node.host_block >= 0 and self.host is not None:
            self.host.refresh(node)  # on both tiers now: its host copy may be dropped

    def _replace_idle(self, node: Node, block_id: int, lru_key: int) -> None:
        """node's idle block (ref count 1) leaves for the free queue; block_id (held by the caller, not cached) takes
        its place with the tree's reference. Bumps epoch: a match naming the old block is stale. O(log n)."""
        rcs, by_block, old = self.pool.ref_counts, self._by_block, node.block_id
        if rcs[block_id] == 0 or by_block[block_id] is not None:
            raise ValueError(f"block {block_id} is free or already cached")
        if node.num_device_children == 0:
            self._lru.remove(node.lru_key)
        self._num_evictable -= 1
        by_block[old], by_block[block_id] = None, node
        node.block_id, node.lru_key = block_id, lru_key
        rcs[block_id] += 1  # >= 2: the caller's reference and the tree's
        self.pool.decref(old)
        self.epoch += 1

    # ----------------------------------------------------------------- references
    def lock(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (cached or not); a cached block stops being evictable.

        Mutates ref counts and the LRU set. O(len(block_ids) * log n) at worst, O(1) per block not leaving the LRU.
        Raises:
            ValueError: a block is free (nothing after it is locked).
        """
        rcs, by_block = self.pool.ref_counts, self._by_block
        for block_id in block_ids:
            rc = rcs[block_id]
            if rc == 0:
                raise ValueError(f"lock of free block {block_id}")
            rcs[block_id] = rc + 1
            if rc == 1:
                node = by_block[block_id]
                if node is not None:
                    self._num_evictable -= 1
                    if node.num_device_children == 0:
                        self._lru.remove(node.lru_key)

    def unlock(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. A private block at 0 goes to the free queue; a cached block left with
        only the tree's reference becomes evictable, last accessed now. O(len(block_ids) * log n) at worst.

        Raises:
            ValueError: a block is already free (nothing after it is unlocked).
        """
        pool, by_block = self.pool, self._by_block
        rcs = pool.ref_counts
        tick = self._tick() << ID_BITS
        for block_id in block_ids:
            rc = rcs[block_id]
            if rc <= 1:
                pool.decref(block_id)  # to the free queue (or ValueError for a free block)
                continue
            rcs[block_id] = rc - 1
            if rc == 2:
                node = by_block[block_id]
                if node is not None:
                    self._num_evictable += 1
                    node.lru_key = tick | block_id
                    if node.num_device_children == 0:
                        self._lru.add(node.lru_key)

    # ----------------------------------------------------------------- removal
    def uncache(self, block_ids: Sequence[int]) -> int:
        """Take cached leaves out of the tree, in the given order (children first), stopping at the first block that
        is not a cached leaf (on the device, no child on either tier). The tree's references are dropped (a host copy
        goes too); other holders keep the block as a private block. Used so that no block past a stop string stays
        cached. Returns how many were removed; emits BlockRemoved and bumps epoch if any. O(len(block_ids) * log n)."""
        removed = 0
        for block_id in block_ids:
            node = self._by_block[block_id]
            if node is None or node.children is not None:
                break
            if self.pool.ref_counts[block_id] == 1:
                self._num_evictable -= 1
                self._lru.remove(node.lru_key)
            self._unlink(node, None)
            self.pool.decref(block_id)
            removed += 1
        if removed:
            self.epoch += 1
            self._emit_moves()
        return removed

    def clear(self) -> bool:
        """Drop every cached block of both tiers at once if every device block is evictable and no host block is
        pinned by a pending copy (emits AllBlocksCleared, bumps epoch); else change nothing and return False.
        O(nodes)."""
        host = self.host
        if self._num_evictable != self._num_device or (host is not None and host.num_pinned):
            return False
        for node in self._nodes.values():
            if node.block_id >= 0:
                self._by_block[node.block_id] = None
                self.pool.decref(node.block_id)
            if host is not None and node.host_block >= 0:
                host.detach(node)
        self._nodes.clear()
        self._roots = {None: Root(None)}
        self._lru.clear()
        self._num_evictable = self._num_device = 0
        self.epoch += 1
        self.events.cleared()
        return True
