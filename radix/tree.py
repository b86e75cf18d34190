"""Radix tree of full, hashed KV blocks: match, insert (de-duplicating), lock/unlock, LRU eviction of leaves.

Shape: one node per block, found through one dict keyed by the block's chained hash (radix/hashing.py), not
compressed runs split on divergence. Why: a chained hash already names the whole prefix, so a lookup is one dict
probe per block (O(1), no token-by-token walk and no split/merge code); a block is the unit of sharing, locking and
eviction anyway, so per-block nodes make ref counting and leaf eviction exact; and the router speaks in block hashes,
so the tree answers a list of hashes directly. Nodes keep no children dict (only a child count), which keeps a cached
block at a few hundred bytes (benchmarks/radix_ops.py measures it).

Collision safety: each node stores its block ``key`` (the exact byte encoding of its tokens and extra keys) and its
parent; a hash hit counts only when both match, so a colliding hash can never return another prefix's KV.

References: the tree holds one reference (BlockPool ref count) to each cached block. A cached block whose only
reference is the tree's (ref count 1) is *evictable*; as the manager keeps every sequence referencing the whole
cached path it uses ("path property": ref count >= 2 implies the parent's is too), every evictable block can be
reclaimed by evicting leaves, children before parents. Evictable leaves sit in a ``sortedcontainers.SortedList`` keyed
by ``last_access << 32 | block_id`` (last_access is a logical clock bumped per unlock/insert call), so eviction pops the
least recently used leaf in O(log n) and never scans the tree.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from sortedcontainers import SortedList

from radix.block_pool import BlockPool
from radix.events import KvEventLog
from radix.hashing import BlockHash, ExtraKey, HashFn, blake2b_128, block_key, hash_block

logger = logging.getLogger(__name__)

_ID_BITS = 32
_ID_MASK = (1 << _ID_BITS) - 1


class _Node:
    __slots__ = ("block_id", "block_hash", "key", "parent", "num_children", "lru_key")

    def __init__(self, block_id: int, block_hash: BlockHash, key: bytes, parent: _Node | None, lru_key: int) -> None:
        self.block_id = block_id
        self.block_hash = block_hash
        self.key = key
        self.parent = parent
        self.num_children = 0
        self.lru_key = lru_key


class TreeMatch(NamedTuple):
    """Cached prefix: block ids and their chained hashes, one per matched full block, root first."""

    block_ids: list[int]
    block_hashes: list[BlockHash]


class InsertResult(NamedTuple):
    """resident: the tree's block for each processed block (a prefix of the input; shorter when a hash collided).
    duplicates: given block ids that were not inserted because an identical block is resident (the caller keeps and
    later releases them)."""

    resident: list[int]
    duplicates: list[int]


class RadixTree:
    """Cached full blocks of ``block_size`` tokens over the physical blocks of ``pool``.

    Args:
        pool: the device BlockPool; the tree increfs a block it caches and decrefs it on eviction.
        block_size: tokens per block.
        hash_fn: block digest function (default BLAKE2b-128; tests inject a weak one).
        events: where BlockStored / BlockRemoved / AllBlocksCleared go (None: not recorded).
    """

    def __init__(
        self, pool: BlockPool, block_size: int, hash_fn: HashFn = blake2b_128, events: KvEventLog | None = None
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.events = events if events is not None else KvEventLog(enabled=False)
        self._nodes: dict[BlockHash, _Node] = {}
        self._by_block: list[_Node | None] = [None] * pool.num_blocks
        self._lru: SortedList = SortedList()
        self._clock = 0
        self._num_evictable = 0
        self._removed: list[BlockHash] = []  # hashes removed by the current evict/uncache call

    # ----------------------------------------------------------------- queries
    @property
    def num_cached(self) -> int:
        """Blocks in the tree."""
        return len(self._nodes)

    @property
    def num_evictable(self) -> int:
        """Cached blocks whose only reference is the tree's (reclaimable by evicting leaves first)."""
        return self._num_evictable

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is a node of the tree."""
        return self._by_block[block_id] is not None

    def is_leaf(self, block_id: int) -> bool:
        """Whether the cached block has no cached child. Raises KeyError if it is not cached."""
        node = self._by_block[block_id]
        if node is None:
            raise KeyError(f"block {block_id} is not cached")
        return node.num_children == 0

    def block_hash(self, block_id: int) -> BlockHash | None:
        """Hash of a cached block, None if the block is not cached."""
        node = self._by_block[block_id]
        return None if node is None else node.block_hash

    def resident_block(self, block_hash: BlockHash) -> int | None:
        """Block id cached under ``block_hash``, None if absent. O(1)."""
        node = self._nodes.get(block_hash)
        return None if node is None else node.block_id

    def hashes(self) -> list[BlockHash]:
        """Hashes of all cached blocks (insertion order). O(num_cached)."""
        return list(self._nodes)

    def lru_order(self) -> list[int]:
        """Evictable leaves, next victim first (for tests). O(number of such leaves)."""
        return [key & _ID_MASK for key in self._lru]

    def lookup(self, parent_hash: BlockHash | None, block_hash: BlockHash, key: bytes) -> int | None:
        """Block id cached for (parent, key) under ``block_hash``, or None; a hash hit whose key or parent differs
        (a collision) is a miss. O(len(key))."""
        node = self._nodes.get(block_hash)
        if node is None or node.key != key:
            return None
        parent = node.parent
        if (None if parent is None else parent.block_hash) != parent_hash:
            return None
        return node.block_id

    def match(
        self, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = (), max_blocks: int | None = None
    ) -> TreeMatch:
        """Longest cached prefix of the full blocks of ``token_ids`` (extra_keys enter the first block).

        Pure: takes no reference and leaves the LRU order alone. O(matched blocks * block_size).
        """
        bs = self.block_size
        n = len(token_ids) // bs
        if max_blocks is not None:
            n = min(n, max_blocks)
        block_ids: list[int] = []
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for i in range(n):
            key = block_key(token_ids[i * bs : (i + 1) * bs], extra_keys if i == 0 else ())
            h = hash_block(parent, key, self.hash_fn)
            block_id = self.lookup(parent, h, key)
            if block_id is None:
                break
            block_ids.append(block_id)
            hashes.append(h)
            parent = h
        return TreeMatch(block_ids, hashes)

    def match_hashes(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of a chain of hashes (router use: no tokens to compare, so this
        trusts the collision resistance of the default hash). Pure. O(len(block_hashes))."""
        block_ids: list[int] = []
        parent: _Node | None = None
        for h in block_hashes:
            node = self._nodes.get(h)
            if node is None or node.parent is not parent:
                break
            block_ids.append(node.block_id)
            parent = node
        return block_ids

    # ----------------------------------------------------------------- insert
    def insert_chain(
        self,
        parent_hash: BlockHash | None,
        block_hashes: Sequence[BlockHash],
        keys: Sequence[bytes],
        block_ids: Sequence[int],
    ) -> InsertResult:
        """Insert consecutive full blocks hanging under the cached block ``parent_hash`` (None: the root).

        A block whose (hash, key, parent) is resident is a duplicate: the resident block stays, the given one is not
        inserted. A new block gets a tree reference (its ref count + 1) and becomes a child of the previous one.
        Stops early (shorter ``resident``) on a hash collision or when ``parent_hash`` is not cached.
        Emits one BlockStored for the new blocks. Only call once the blocks' KV is written. O(len(block_ids)).

        Raises:
            ValueError: a block id is already cached under another hash, or is free.
        """
        parent = None if parent_hash is None else self._nodes.get(parent_hash)
        if parent_hash is not None and parent is None:
            return InsertResult([], [])
        resident: list[int] = []
        duplicates: list[int] = []
        stored: list[BlockHash] = []
        stored_parent: BlockHash | None = None
        tick = self._tick()
        for h, key, block_id in zip(block_hashes, keys, block_ids, strict=True):
            node = self._nodes.get(h)
            if node is not None:
                if node.key != key or node.parent is not parent:
                    logger.debug("block hash collision at block %d; not cached", block_id)
                    break
                if node.block_id != block_id:
                    duplicates.append(block_id)
            else:
                if self._by_block[block_id] is not None:
                    raise ValueError(f"block {block_id} is already cached under another hash")
                node = self._add_node(block_id, h, key, parent, tick)
                if not stored:
                    stored_parent = None if parent is None else parent.block_hash
                stored.append(h)
            resident.append(node.block_id)
            parent = node
        self.events.stored(stored, stored_parent, self.block_size)
        return InsertResult(resident, duplicates)

    def insert(
        self, token_ids: Sequence[int], block_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()
    ) -> InsertResult:
        """Insert the full blocks of ``token_ids`` held in ``block_ids`` (block i holds tokens [i*B, (i+1)*B)),
        from the root. Same contract as insert_chain. O(len(token_ids))."""
        bs = self.block_size
        n = min(len(token_ids) // bs, len(block_ids))
        keys, hashes = [], []
        parent: BlockHash | None = None
        for i in range(n):
            key = block_key(token_ids[i * bs : (i + 1) * bs], extra_keys if i == 0 else ())
            parent = hash_block(parent, key, self.hash_fn)
            keys.append(key)
            hashes.append(parent)
        return self.insert_chain(None, hashes, keys, list(block_ids[:n]))

    def _add_node(self, block_id: int, h: BlockHash, key: bytes, parent: _Node | None, tick: int) -> _Node:
        rc = self.pool.incref(block_id)
        node = _Node(block_id, h, key, parent, (tick << _ID_BITS) | block_id)
        self._nodes[h] = node
        self._by_block[block_id] = node
        if parent is not None:
            if parent.num_children == 0 and self.pool.ref_counts[parent.block_id] == 1:
                self._lru.remove(parent.lru_key)
            parent.num_children += 1
        if rc == 1:  # the caller held no reference: cached and idle at once
            self._num_evictable += 1
            self._lru.add(node.lru_key)
        return node

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ----------------------------------------------------------------- references
    def lock(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (cached or not); a cached block stops being evictable.

        Mutates ref counts and the LRU set. O(len(block_ids) * log n). Raises ValueError for a free block.
        """
        pool, by_block = self.pool, self._by_block
        for block_id in block_ids:
            rc = pool.incref(block_id)
            node = by_block[block_id]
            if rc == 2 and node is not None:
                self._num_evictable -= 1
                if node.num_children == 0:
                    self._lru.remove(node.lru_key)

    def unlock(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. A private block at 0 goes to the free queue; a cached block left with
        only the tree's reference becomes evictable, last accessed now. O(len(block_ids) * log n).

        Raises:
            ValueError: a block is already free.
        """
        pool, by_block = self.pool, self._by_block
        tick = self._tick() << _ID_BITS
        for block_id in block_ids:
            rc = pool.decref(block_id)
            node = by_block[block_id]
            if rc == 1 and node is not None:
                self._num_evictable += 1
                node.lru_key = tick | block_id
                if node.num_children == 0:
                    self._lru.add(node.lru_key)

    # ----------------------------------------------------------------- removal
    def evict(self, n: int) -> list[int]:
        """Free up to ``n`` evictable blocks, least recently used leaf first; a parent whose last child goes becomes
        a leaf and competes by its own last access. Returns the freed block ids in eviction order (now on the pool's
        free queue). Emits one BlockRemoved. O(n log N), no scan."""
        freed: list[int] = []
        lru = self._lru
        while len(freed) < n and lru:
            node = self._by_block[lru.pop(0) & _ID_MASK]
            self._num_evictable -= 1
            self._remove_node(node)
            freed.append(node.block_id)
        self.events.removed(self._take_removed())
        return freed

    def _take_removed(self) -> list[BlockHash]:
        hashes, self._removed = self._removed, []
        return hashes

    def uncache(self, block_ids: Sequence[int]) -> int:
        """Take cached leaves out of the tree, in the given order (children first), stopping at the first block that
        is not a cached leaf. The tree's reference is dropped; other holders keep the block as a private block. Used
        so that no block past a stop string stays cached. Returns how many were removed; emits one BlockRemoved.
        O(len(block_ids) * log n)."""
        removed = 0
        for block_id in block_ids:
            node = self._by_block[block_id]
            if node is None or node.num_children:
                break
            if self.pool.ref_counts[block_id] == 1:
                self._num_evictable -= 1
                self._lru.remove(node.lru_key)
            self._remove_node(node)
            removed += 1
        self.events.removed(self._take_removed())
        return removed

    def _remove_node(self, node: _Node) -> None:
        del self._nodes[node.block_hash]
        self._by_block[node.block_id] = None
        self._removed.append(node.block_hash)
        parent = node.parent
        if parent is not None:
            parent.num_children -= 1
            if parent.num_children == 0 and self.pool.ref_counts[parent.block_id] == 1:
                self._lru.add(parent.lru_key)
        self.pool.decref(node.block_id)

    def clear(self) -> bool:
        """Drop every cached block at once if all are evictable (emits AllBlocksCleared); else change nothing and
        return False. O(num_cached)."""
        if self._num_evictable != len(self._nodes):
            return False
        for node in self._nodes.values():
            self._by_block[node.block_id] = None
            self.pool.decref(node.block_id)
        self._nodes.clear()
        self._lru.clear()
        self._num_evictable = 0
        self.events.cleared()
        return True

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Nodes, child counts, evictable count, LRU set and the path property are consistent. O(num_cached).

        Raises:
            AssertionError: naming the offending block.
        """
        rc = self.pool.ref_counts
        children: dict[int, int] = {}
        evictable = 0
        for h, node in self._nodes.items():
            b = node.block_id
            assert node.block_hash == h, f"node {b} filed under another hash"
            assert self._by_block[b] is node, f"block {b} not indexed by id"
            assert rc[b] >= 1, f"cached block {b} has ref count {rc[b]}"
            evictable += rc[b] == 1
            parent = node.parent
            if parent is not None:
                assert self._nodes.get(parent.block_hash) is parent, f"cached block {b} has an uncached parent"
                children[parent.block_id] = children.get(parent.block_id, 0) + 1
                assert rc[b] == 1 or rc[parent.block_id] >= 2, f"block {b} in use but its parent is only cached"
        indexed = sum(node is not None for node in self._by_block)
        assert indexed == len(self._nodes), f"{indexed} blocks indexed, {len(self._nodes)} nodes"
        for node in self._nodes.values():
            n = children.get(node.block_id, 0)
            assert node.num_children == n, f"block {node.block_id}: child count {node.num_children}, real {n}"
        assert evictable == self._num_evictable, f"evictable count {self._num_evictable}, real {evictable}"
        want = sorted(n.lru_key for n in self._nodes.values() if n.num_children == 0 and rc[n.block_id] == 1)
        assert list(self._lru) == want, f"LRU set {self.lru_order()} != evictable leaves {want}"
