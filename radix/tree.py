"""Radix tree of full KV blocks: match by tokens, insert (de-duplicating), lock/unlock, uncache, clear, and a
sequence's cached prefix; the prefix cache of a manager with prefix caching on (radix/prefix_cache.py). Its nodes and
indexes are a TreeNodes (radix/tree_nodes.py); its eviction and the moves between the device and host tiers are a
TierMoves part (radix/tier_moves.py) over the same nodes.

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
from collections.abc import Callable, Sequence

from radix.block_pool import BlockPool
from radix.events import KvEventLog
from radix.hashing import BlockHash, HashFn, blake2b_128, hash_packed_block
from radix.host_tier import HostTier
from radix.invariants import check_host_tier, check_tree
from radix.keys import BlockKeys
from radix.node import ID_BITS, ID_MASK, NOT_RESIDENT, InsertResult, Node, Root, TreeMatch, salt_under
from radix.prefix_cache import PrefixCache
from radix.sequence import SeqBlocks
from radix.tier_moves import TierMoves
from radix.tree_nodes import TreeNodes

logger = logging.getLogger(__name__)

__all__ = ["InsertResult", "Node", "RadixTree", "Root", "TreeMatch"]


class RadixTree(PrefixCache):
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
        self.host = host
        self._nodes = TreeNodes(pool, block_size, events if events is not None else KvEventLog(enabled=False), host)
        self._moves = TierMoves(self._nodes)

    # ----------------------------------------------------------------- queries
    @property
    def events(self) -> KvEventLog:
        """The event log the tree records into. O(1)."""
        return self._nodes.events

    @property
    def epoch(self) -> int:
        """Calls so far that removed blocks from a tier or moved a node between tiers (module docstring). O(1)."""
        return self._nodes.epoch

    @property
    def num_cached(self) -> int:
        """Device-resident blocks in the tree. O(1)."""
        return self._nodes.num_device

    @property
    def num_nodes(self) -> int:
        """Blocks in the tree on either tier. O(1)."""
        return len(self._nodes.by_hash)

    @property
    def num_evictable(self) -> int:
        """Device blocks whose only reference is the tree's (reclaimable by evicting device leaves first). O(1)."""
        return self._nodes.num_evictable

    def block_hash(self, block_id: int) -> BlockHash | None:
        """Hash of a cached device block, None if the block is not cached. O(1)."""
        node = self._nodes.by_block[block_id]
        return None if node is None else node.block_hash

    def resident_block(self, block_hash: BlockHash) -> int | None:
        """Device block id cached under ``block_hash``, None if absent or on the host only. O(1)."""
        node = self._nodes.by_hash.get(block_hash)
        return None if node is None or node.block_id < 0 else node.block_id

    def host_block(self, block_hash: BlockHash) -> int | None:
        """Host-tier block id holding ``block_hash``, None if it has no host copy. O(1)."""
        node = self._nodes.by_hash.get(block_hash)
        return None if node is None or node.host_block < 0 else node.host_block

    def hashes(self) -> list[BlockHash]:
        """Hashes of the device-resident blocks (insertion order). O(nodes)."""
        return [h for h, node in self._nodes.by_hash.items() if node.block_id >= 0]

    def host_hashes(self) -> list[BlockHash]:
        """Hashes of the blocks with a host copy (insertion order). O(nodes)."""
        return [h for h, node in self._nodes.by_hash.items() if node.host_block >= 0]

    def holds(self, node: Node) -> bool:
        """Whether node is in the tree now (on either tier). O(1)."""
        return node.block_hash is not None and self._nodes.by_hash.get(node.block_hash) is node

    def watch_forget(self, callback: Callable[[Node], None]) -> None:
        """Call callback(node) for each node leaving the tree from now on (a window group drops its block). O(1)."""
        self._nodes.on_forget = callback

    def lru_order(self) -> list[int]:
        """Evictable device leaves, next victim first (for tests). O(number of such leaves)."""
        return [key & ID_MASK for key in self._nodes.lru]

    def host_lru_order(self) -> list[int]:
        """Droppable host copies (host block ids), next victim first (for tests). [] without a host tier. O(copies)."""
        if self.host is None:
            return []
        return [key & ID_MASK for key in self.host.lru]

    def block_keys(self, token_ids: Sequence[int], cache_salt: str | None) -> BlockKeys:
        """Chained keys (radix/keys.py): their chain ids let the scheduler wait for blocks computed now. Pure,
        O(len(token_ids)). Raises ValueError: a bad token id."""
        return BlockKeys(token_ids, self.block_size, cache_salt)

    def match(self, blocks: Sequence[bytes], salt: str | None, max_blocks: int) -> TreeMatch:
        """Longest cached prefix of ``blocks`` (packed tokens, radix/keys.py) in salt's subtree, at most max_blocks,
        on either tier: the device-resident blocks, then the host-only nodes after them.

        Pure: takes no reference, leaves the LRU order alone, hashes nothing. O(matched blocks) dict probes.
        """
        node: Node | None = self._nodes.roots.get(salt)
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
        nodes = self._nodes
        if parent is None:
            parent = nodes.root(salt)
        resident: list[int] = []
        duplicates: list[int] = []
        stored: list[BlockHash] = []
        stored_keys: list[bytes] = []
        stored_parent: BlockHash | None = None
        first_salt: str | None = None
        lru_tick = nodes.tick() << ID_BITS
        hash_fn = self.hash_fn
        by_hash = nodes.by_hash
        by_block = nodes.by_block
        rcs = self.pool.ref_counts
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
                    if h in by_hash:
                        logger.debug("block hash collision at block %d; not cached", block_id)
                        break
                    node = Node(NOT_RESIDENT, h, key, parent, 0)
                    by_hash[h] = node
                    if children is None:
                        parent.children = {key: node}
                    else:
                        children[key] = node
                else:
                    nodes.epoch += 1  # a match that named it host-only would load it back
                nodes.take_device_block(node, block_id, lru_tick | block_id)
                if not stored:
                    stored_parent = parent.block_hash
                    first_salt = salt_under(parent)
                assert node.block_hash is not None
                stored.append(node.block_hash)
                stored_keys.append(key)
            elif node.block_id != block_id:
                if rcs[node.block_id] == 1:
                    nodes.replace_idle(node, block_id, lru_tick | block_id)
                else:
                    duplicates.append(block_id)
            resident.append(node.block_id)
            parent = node
        salts = [first_salt] + [None] * (len(stored) - 1)
        nodes.events.stored(stored, stored_parent, self.block_size, keys=stored_keys, salts=salts)
        return InsertResult(resident, duplicates, None if type(parent) is Root else parent)

    def cache_full_blocks(self, seq: SeqBlocks, num_full_blocks: int) -> None:
        """Insert seq's blocks [num_cached_blocks, num_full_blocks) (capped at its table; their KV must be written)
        under its cached_node, de-duplicating: an idle resident duplicate is replaced by its block (and freed,
        insert_chain); one in use becomes a shadow of seq (one more reference). Mutates seq and the tree.
        O(new blocks) plus one hash per block new to the tree."""
        start = seq.num_cached_blocks
        end = min(num_full_blocks, len(seq.block_table))
        if end <= start:
            return
        table = seq.block_table
        found = self.insert_chain(seq.cached_node, seq.cache_salt, seq.blocks[start:end], table[start:end])
        resident = found.resident
        if not resident:
            return
        shadow = [r for r, b in zip(resident, table[start:end], strict=False) if r != b]  # resident may be shorter
        if shadow:
            self.lock(shadow)
            seq.shadow.extend(shadow)
        seq.cached_node = found.last_node
        seq.num_cached_blocks += len(resident)

    # ----------------------------------------------------------------- references
    def lock(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (cached or not); a cached block stops being evictable.

        Mutates ref counts and the LRU set. O(len(block_ids) * log n) at worst, O(1) per block not leaving the LRU.
        Raises:
            ValueError: a block is free (nothing after it is locked).
        """
        nodes = self._nodes
        rcs = self.pool.ref_counts
        by_block = nodes.by_block
        for block_id in block_ids:
            rc = rcs[block_id]
            if rc == 0:
                raise ValueError(f"lock of free block {block_id}")
            rcs[block_id] = rc + 1
            if rc == 1:
                node = by_block[block_id]
                if node is not None:
                    nodes.num_evictable -= 1
                    if node.num_device_children == 0:
                        nodes.lru.remove(node.lru_key)

    def unlock(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. A private block at 0 goes to the free queue; a cached block left with
        only the tree's reference becomes evictable, last accessed now. O(len(block_ids) * log n) at worst.

        Raises:
            ValueError: a block is already free (nothing after it is unlocked).
        """
        nodes = self._nodes
        pool = self.pool
        by_block = nodes.by_block
        rcs = pool.ref_counts
        tick = nodes.tick() << ID_BITS
        for block_id in block_ids:
            rc = rcs[block_id]
            if rc <= 1:
                pool.decref(block_id)  # to the free queue (or ValueError for a free block)
                continue
            rcs[block_id] = rc - 1
            if rc == 2:
                node = by_block[block_id]
                if node is not None:
                    nodes.num_evictable += 1
                    node.lru_key = tick | block_id
                    if node.num_device_children == 0:
                        nodes.lru.add(node.lru_key)

    # ----------------------------------------------------------------- removal
    def evict(self, n: int) -> list[int]:
        """Free up to n evictable device blocks, least recently used device leaf first, writing them back to the
        host tier or dropping them (TierMoves.evict, radix/tier_moves.py, which states the events). O(n log N)."""
        return self._moves.evict(n)

    def uncache(self, block_ids: Sequence[int]) -> int:
        """Take cached leaves out of the tree, in the given order (children first), stopping at the first block that
        is not a cached leaf (on the device, no child on either tier). The tree's references are dropped (a host copy
        goes too); other holders keep the block as a private block. Used so that no block past a stop string stays
        cached. Returns how many were removed; emits BlockRemoved and bumps epoch if any. O(len(block_ids) * log n)."""
        nodes = self._nodes
        removed = 0
        for block_id in block_ids:
            node = nodes.by_block[block_id]
            if node is None or node.children is not None:
                break
            if self.pool.ref_counts[block_id] == 1:
                nodes.num_evictable -= 1
                nodes.lru.remove(node.lru_key)
            nodes.unlink(node, None)
            self.pool.decref(block_id)
            removed += 1
        if removed:
            nodes.epoch += 1
            nodes.emit_moves()
        return removed

    def uncache_past(self, seq: SeqBlocks, keep_blocks: int) -> None:
        """Take out of the tree seq's cached blocks from keep_blocks on that only it (and the tree) holds, deepest
        first, stopping at the first one shared or not its own (a stop string ended the text there). Mutates seq and
        the tree. O(blocks past keep_blocks * log n)."""
        rcs = self.pool.ref_counts
        node = seq.cached_node
        own = []  # deepest first
        for i in range(seq.num_cached_blocks - 1, keep_blocks - 1, -1):
            assert node is not None
            block_id = seq.block_table[i]
            if rcs[block_id] != 2 or node.block_id != block_id:
                break
            own.append(block_id)
            node = node.parent
        removed = self.uncache(own)
        for _ in range(removed):
            assert seq.cached_node is not None
            seq.cached_node = seq.cached_node.parent
        seq.num_cached_blocks -= removed
        if seq.num_cached_blocks == 0:
            seq.cached_node = None  # the salt's root: insert_chain finds it again

    def clear(self) -> bool:
        """Drop every cached block of both tiers at once if every device block is evictable and no host block is
        pinned by a pending copy (emits AllBlocksCleared, bumps epoch); else change nothing and return False.
        O(nodes)."""
        return self._nodes.clear()

    # ----------------------------------------------------------------- load-back
    def pin_for_load(self, nodes: Sequence[Node]) -> None:
        """Pin the host copies of a matched host-only chain (TierMoves.pin_for_load). O(len * log n). Raises
        ValueError: a node is on the device or has no host copy (a stale match)."""
        self._moves.pin_for_load(nodes)

    def load_back(self, nodes: Sequence[Node], device_blocks: Sequence[int]) -> None:
        """Give the pinned host-only chain its device blocks and schedule the host -> device copies
        (TierMoves.load_back: emits one BlockStored, bumps epoch). O(len * log n). Raises ValueError: lengths
        differ, or a device block is free or already cached (nothing changed)."""
        self._moves.load_back(nodes, device_blocks)

    def check_invariants(self) -> None:
        """Nodes, indexes, tiers, counts, the device LRU (radix/invariants.py check_tree) and the host tier's own
        invariant (check_host_tier). O(nodes + blocks). Raises AssertionError naming the offending block."""
        check_tree(self._nodes)
        if self.host is not None:
            check_host_tier(self.host, self._nodes)
