"""Radix tree of full KV blocks: match by tokens, insert (de-duplicating), lock/unlock, LRU eviction of leaves.

Shape: one node per block. A node's children are a dict keyed by the child block's packed tokens (radix/keys.py):
a match walks the prompt block by block with one dict probe each (exact comparison, Python's native bytes hashing;
no cryptographic hash, no token-by-token loop, no split/merge code: a block is the unit of sharing, locking and
eviction anyway, so per-block nodes make ref counting and leaf eviction exact). Each cache_salt has its own root, so
tenants never share a block; an empty salted root is dropped with its last child.

Naming: when a block first enters the tree it gets its chained content hash (radix/hashing.py: BLAKE2b over the parent
hash, the tokens and, on the first block, the salt), computed exactly once. The hash names the block in KV events and
snapshots, and a second index (hash -> node) answers the router's chains of hashes (``match_hashes``). A new block
whose hash is already taken by another resident block (a collision: never seen with BLAKE2b-128, forced in tests with
a weak hash) is not cached, so a hash always names exactly one block.

References: the tree holds one reference (BlockPool ref count) to each cached block. A cached block whose only
reference is the tree's (ref count 1) is *evictable*; as the manager keeps every sequence referencing the whole
cached path it uses ("path property": ref count >= 2 implies the parent's is too), every evictable block can be
reclaimed by evicting leaves, children before parents. Evictable leaves sit in a ``sortedcontainers.SortedList`` keyed
by ``last_access << 32 | block_id`` (last_access is a logical clock bumped per unlock/insert call), so eviction pops the
least recently used leaf in O(log n) and never scans the tree.

``epoch`` counts the calls that removed blocks (evict, uncache, clear, an idle duplicate replaced by insert_chain): a
match taken at epoch e names resident blocks only while the epoch is still e (radix/manager.py checks it before
locking a match).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from sortedcontainers import SortedList

from radix.block_pool import BlockPool
from radix.events import KvEventLog
from radix.hashing import BlockHash, HashFn, blake2b_128, hash_packed_block

logger = logging.getLogger(__name__)

_ID_BITS = 32
_ID_MASK = (1 << _ID_BITS) - 1


class Node:
    """One cached block (or, with block_id -1, the root of one salt's subtree). Owned by the RadixTree; callers hold
    a Node only as an opaque handle (PrefixMatch.last_node, SeqBlocks.cached_node) while they reference its block.

    key: the block's packed tokens (the parent's children dict key). children: None until the first child.
    lru_key: last_access << 32 | block_id (meaningful while evictable).
    """

    __slots__ = ("block_id", "block_hash", "key", "parent", "children", "lru_key")

    def __init__(self, block_id: int, block_hash: BlockHash | None, key: bytes, parent: Node | None, lru_key: int):
        self.block_id = block_id
        self.block_hash = block_hash
        self.key = key
        self.parent = parent
        self.children: dict[bytes, Node] | None = None
        self.lru_key = lru_key


class _Root(Node):
    """The root of one cache_salt's subtree (no block)."""

    __slots__ = ("salt",)

    def __init__(self, salt: str | None) -> None:
        super().__init__(-1, None, b"", None, 0)
        self.salt = salt


class TreeMatch(NamedTuple):
    """Cached prefix: block ids root first, and the node of the last one (None when nothing matched)."""

    block_ids: list[int]
    last_node: Node | None


class InsertResult(NamedTuple):
    """resident: the tree's block for each processed block (a prefix of the input; shorter after a hash collision).
    duplicates: given block ids that were not inserted because an identical block is resident and in use (the caller
    keeps and later releases them). last_node: the node of the last resident block (the given parent when none)."""

    resident: list[int]
    duplicates: list[int]
    last_node: Node | None


class RadixTree:
    """Cached full blocks of ``block_size`` tokens over the physical blocks of ``pool``.

    Args:
        pool: the device BlockPool; the tree increfs a block it caches and decrefs it on eviction.
        block_size: tokens per block.
        hash_fn: block digest function (default BLAKE2b-128; tests inject a weak one).
        events: where BlockStored / BlockRemoved / AllBlocksCleared go (None: not recorded).
    Block ids passed to any method must be the pool's (1 .. num_blocks - 1); they are not range-checked here.
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
        self.epoch = 0
        self._roots: dict[str | None, _Root] = {None: _Root(None)}
        self._nodes: dict[BlockHash, Node] = {}
        self._by_block: list[Node | None] = [None] * pool.num_blocks
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

    def block_hash(self, block_id: int) -> BlockHash | None:
        """Hash of a cached block, None if the block is not cached. O(1)."""
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

    def match(self, blocks: Sequence[bytes], salt: str | None, max_blocks: int) -> TreeMatch:
        """Longest cached prefix of ``blocks`` (packed tokens, radix/keys.py) in salt's subtree, at most max_blocks.

        Pure: takes no reference, leaves the LRU order alone, hashes nothing. O(matched blocks) dict probes.
        """
        node: Node | None = self._roots.get(salt)
        block_ids: list[int] = []
        if node is None:
            return TreeMatch(block_ids, None)
        append = block_ids.append
        for key in blocks[:max_blocks] if max_blocks < len(blocks) else blocks:
            children = node.children
            if children is None:
                break
            child = children.get(key)
            if child is None:
                break
            append(child.block_id)
            node = child
        return TreeMatch(block_ids, node if block_ids else None)

    def match_hashes(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of a chain of hashes starting at a root (router use: no tokens to
        compare, so this trusts the collision resistance of the default hash). Pure. O(len(block_hashes))."""
        block_ids: list[int] = []
        parent: Node | None = None
        for h in block_hashes:
            node = self._nodes.get(h)
            if node is None or (node.parent is not parent if parent is not None else type(node.parent) is not _Root):
                break
            block_ids.append(node.block_id)
            parent = node
        return block_ids

    # ----------------------------------------------------------------- insert
    def insert_chain(
        self, parent: Node | None, salt: str | None, blocks: Sequence[bytes], block_ids: Sequence[int]
    ) -> InsertResult:
        """Insert consecutive full blocks (packed tokens ``blocks``, held in ``block_ids``) under ``parent``, a node
        the caller holds a reference to (None: the root of salt's subtree; salt is ignored otherwise).

        A block whose tokens are already a child is a duplicate. When the resident copy is idle (only the tree holds
        it) the tree takes the given block in its place, same node and hash, and frees the idle one (back of the free
        queue; epoch bumped, no event: the hash stays resident), so a sequence never holds two blocks for one block
        of tokens; when it is in use it stays and the given one is not inserted. A new block is hashed (once,
        here), gets a tree reference (its ref count + 1) and becomes a child of the previous one. Stops early
        (shorter ``resident``) on a hash collision. Emits one BlockStored for the new blocks. Only call once the
        blocks' KV is written. O(len(block_ids)) plus one hash per new block.

        Raises:
            ValueError: a new block id is already cached, or is free.
        """
        if parent is None:
            parent = self._roots.get(salt)
            if parent is None:
                parent = self._roots[salt] = _Root(salt)
        resident: list[int] = []
        duplicates: list[int] = []
        stored: list[BlockHash] = []
        stored_parent: BlockHash | None = None
        lru_tick = self._tick() << _ID_BITS
        hash_fn, nodes, by_block, rcs = self.hash_fn, self._nodes, self._by_block, self.pool.ref_counts
        for key, block_id in zip(blocks, block_ids, strict=True):
            children = parent.children
            node = None if children is None else children.get(key)
            if node is None:
                h = hash_packed_block(parent.block_hash, key, parent.salt if type(parent) is _Root else None, hash_fn)
                if h in nodes:
                    logger.debug("block hash collision at block %d; not cached", block_id)
                    break
                rc = rcs[block_id]
                if rc == 0 or by_block[block_id] is not None:
                    raise ValueError(f"block {block_id} is free or already cached")
                rcs[block_id] = rc + 1  # >= 2: the caller's reference and the tree's, so not idle
                node = Node(block_id, h, key, parent, lru_tick | block_id)
                nodes[h] = node
                by_block[block_id] = node
                if children is None:
                    if type(parent) is not _Root and rcs[parent.block_id] == 1:
                        self._lru.remove(parent.lru_key)  # an idle leaf no more
                    parent.children = {key: node}
                else:
                    children[key] = node
                if not stored:
                    stored_parent = parent.block_hash
                stored.append(h)
            elif node.block_id != block_id:
                if rcs[node.block_id] == 1:
                    self._replace_idle(node, block_id, lru_tick | block_id)
                else:
                    duplicates.append(block_id)
            resident.append(node.block_id)
            parent = node
        self.events.stored(stored, stored_parent, self.block_size)
        return InsertResult(resident, duplicates, None if type(parent) is _Root else parent)

    def _replace_idle(self, node: Node, block_id: int, lru_key: int) -> None:
        """node's idle block (ref count 1) leaves for the free queue; block_id (held by the caller, not cached) takes
        its place with the tree's reference. Bumps epoch: a match naming the old block is stale. O(log n)."""
        rcs, by_block, old = self.pool.ref_counts, self._by_block, node.block_id
        if rcs[block_id] == 0 or by_block[block_id] is not None:
            raise ValueError(f"block {block_id} is free or already cached")
        if node.children is None:
            self._lru.remove(node.lru_key)
        self._num_evictable -= 1
        by_block[old], by_block[block_id] = None, node
        node.block_id, node.lru_key = block_id, lru_key
        rcs[block_id] += 1  # >= 2: the caller's reference and the tree's
        self.pool.decref(old)
        self.epoch += 1

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

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
                    if node.children is None:
                        self._lru.remove(node.lru_key)

    def unlock(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. A private block at 0 goes to the free queue; a cached block left with
        only the tree's reference becomes evictable, last accessed now. O(len(block_ids) * log n) at worst.

        Raises:
            ValueError: a block is already free (nothing after it is unlocked).
        """
        pool, by_block = self.pool, self._by_block
        rcs = pool.ref_counts
        tick = self._tick() << _ID_BITS
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
                    if node.children is None:
                        self._lru.add(node.lru_key)

    # ----------------------------------------------------------------- removal
    def evict(self, n: int) -> list[int]:
        """Free up to ``n`` evictable blocks, least recently used leaf first; a parent whose last child goes becomes
        a leaf and competes by its own last access. Returns the freed block ids in eviction order (now on the pool's
        free queue). Emits one BlockRemoved; bumps epoch if anything went. O(n log N), no scan: a parent that is the
        next victim anyway (its last access older than every other idle leaf's, e.g. the rest of a chain released
        at once) is taken directly, without entering the LRU list."""
        freed: list[int] = []
        lru, by_block = self._lru, self._by_block
        node: Node | None = None
        while len(freed) < n:
            if node is None:
                if not lru:
                    break
                node = by_block[lru.pop(0) & _ID_MASK]
                assert node is not None
            freed.append(node.block_id)
            node = self._unlink(node, lru)
        if node is not None:  # a parent taken out of turn but not needed: back to the LRU list
            lru.add(node.lru_key)
        if freed:
            self._num_evictable -= len(freed)
            self.pool.release_last(freed)
            self.epoch += 1
            self.events.removed(self._take_removed())
        return freed

    def _unlink(self, node: Node, lru: SortedList | None) -> Node | None:
        """Take a leaf out of the tree (its block keeps the tree's reference; the caller drops it). A parent left an
        idle leaf joins the LRU list, or, given lru and when it would be its first entry, is returned instead."""
        h = node.block_hash
        assert h is not None
        del self._nodes[h]
        self._by_block[node.block_id] = None
        self._removed.append(h)
        parent = node.parent
        assert parent is not None and parent.children is not None
        children = parent.children
        del children[node.key]
        if children:
            return None
        parent.children = None
        if type(parent) is _Root:
            if parent.salt is not None:
                del self._roots[parent.salt]
        elif self.pool.ref_counts[parent.block_id] == 1:
            if lru is not None and (not lru or parent.lru_key < lru[0]):
                return parent
            self._lru.add(parent.lru_key)
        return None

    def _take_removed(self) -> list[BlockHash]:
        hashes, self._removed = self._removed, []
        return hashes

    def uncache(self, block_ids: Sequence[int]) -> int:
        """Take cached leaves out of the tree, in the given order (children first), stopping at the first block that
        is not a cached leaf. The tree's reference is dropped; other holders keep the block as a private block. Used
        so that no block past a stop string stays cached. Returns how many were removed; emits one BlockRemoved and
        bumps epoch if any. O(len(block_ids) * log n)."""
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
            self.events.removed(self._take_removed())
        return removed

    def clear(self) -> bool:
        """Drop every cached block at once if all are evictable (emits AllBlocksCleared, bumps epoch); else change
        nothing and return False. O(num_cached)."""
        if self._num_evictable != len(self._nodes):
            return False
        for node in self._nodes.values():
            self._by_block[node.block_id] = None
            self.pool.decref(node.block_id)
        self._nodes.clear()
        self._roots = {None: _Root(None)}
        self._lru.clear()
        self._num_evictable = 0
        self.epoch += 1
        self.events.cleared()
        return True
