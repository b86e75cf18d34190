"""SlidingWindowGroup: the KV cache group of a model's sliding-window layers (window W tokens), a part the
HybridKVCacheManager owns (radix/hybrid_manager.py). The full-attention layers stay group 0, the manager's own pool
and tables; this group has its own BlockPool, one block table per sequence and the tree nodes' window blocks.

Tables are aligned with group 0's: a sequence's table here has one entry per entry of its full table (the same
token positions), so a new position needs one block in each group and the worker's slot for position p is
``table[p // B] * B + p % B`` in either. A query at position q of a sliding layer reads keys k > q - W only
(transformers' sliding-window mask; kernels/reference.py window_start), so once a sequence has computed c tokens no
later query reads block i < first_live(c) = max(0, c - W) // B: those entries are released (NULL_BLOCK), and after a
commit a sequence holds at most cdiv(W, B) + 1 live blocks here. Design after vLLM's SlidingWindowManager (blocks
before the window are freed as the sequence advances) and SGLang's SWARadixCache (a cached node whose window block is
evicted stays, marked); written for this tree.

Caching: when group 0 caches a full block (radix/tree.py), its window block here, still live in the sequence's table,
is attached to the same tree node (this group's reference), unless the node has one already. A cached window block
whose only reference is the node's is evictable on its own, least recently released first (an OrderedDict: O(1)
per block); the node stays in the tree. A tree node that leaves the tree drops its window block (forget, a hook the
tree calls). A cached prefix of h blocks is usable only when the window before its end, blocks [first_live(h * B),
h), is resident here (usable_prefix). ``epoch`` counts the calls that took window blocks from nodes, so a match
naming them is stale after one (radix/prefix_match.py).

Swapping: a sequence preempted by swap moves its live entries (table[first_live:], contiguous) to a host pool of this
group's own, as many blocks as group 0's swap pool: a table here never has more live entries than group 0's has
entries, so whenever group 0's swap pool takes a sequence this one does too. Its NULL entries stay NULL (the window
passed them: no query reads them again), so swapping in takes back only the live ones.

Events (radix/events.py, group 1): BlockStored when nodes take window blocks (cache), BlockRemoved when they lose
them (evict, forget), under the nodes' hashes, into the manager's event log.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from radix.block_pool import NULL_BLOCK, BlockPool, NoFreeBlocksError
from radix.blocks import cdiv
from radix.events import KvEventLog
from radix.hashing import BlockHash
from radix.node import Node, salt_under

GROUP = 1  # this group's number in KV events (radix/events.py)


class SwappedWindow(NamedTuple):
    """A swapped-out sequence's table here: its length (entries) and the host blocks of its live tail, in order."""

    num_entries: int
    host_blocks: list[int]


class SlidingWindowGroup:
    """Window blocks of one sliding-window group (see the module docstring).

    Args:
        num_blocks: blocks of this group's pool including the null block 0, >= 2.
        block_size: tokens per block (group 0's).
        window: W, the layers' sliding window in tokens, >= 1.
        num_host_blocks: this group's host swap pool (ids 0 .. num_host_blocks - 1; group 0's swap pool size), >= 0.
        events: the manager's KV event log (None: no events).
    Raises:
        ValueError: bad sizes.
    Mutates only its own pools, tables and node map; the caller keeps the tables aligned with group 0's.
    """

    def __init__(
        self, num_blocks: int, block_size: int, window: int, num_host_blocks: int = 0, events: KvEventLog | None = None
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks, reserve_null=False)
        self.swapped: dict[int, SwappedWindow] = {}
        self.block_size = block_size
        self.window = window
        self.tables: dict[int, list[int]] = {}
        self.node_block: dict[Node, int] = {}  # cached: tree node -> its window block
        self.block_node: list[Node | None] = [None] * num_blocks
        self.lru: OrderedDict[int, None] = OrderedDict()  # evictable cached blocks, least recently released first
        self.epoch = 0
        self.num_evicted = 0
        self.events = KvEventLog(enabled=False) if events is None else events

    # ----------------------------------------------------------------- the window
    def first_live(self, num_computed: int) -> int:
        """The first block index a query at position num_computed (or later) still reads. O(1)."""
        return max(0, num_computed - self.window) // self.block_size

    def usable_prefix(self, nodes: Sequence[Node]) -> int:
        """The longest h <= len(nodes) such that nodes[first_live(h * B):h] (a matched path, root first) all hold a
        window block here: the cached prefix a sequence may start from. O(len(nodes))."""
        node_block = self.node_block
        last_missing = -1
        missing_before = []  # missing_before[i]: the last index <= i without a window block, or -1
        for i, node in enumerate(nodes):
            if node not in node_block:
                last_missing = i
            missing_before.append(last_missing)
        bs = self.block_size
        for h in range(len(nodes), 0, -1):
            if missing_before[h - 1] < self.first_live(h * bs):
                return h
        return 0

    def window_blocks(self, nodes: Sequence[Node], h: int) -> list[int]:
        """The window blocks of nodes[first_live(h * B):h] (usable_prefix said they are resident). O(window)."""
        return [self.node_block[n] for n in nodes[self.first_live(h * self.block_size) : h]]

    # ----------------------------------------------------------------- capacity
    @property
    def num_evictable(self) -> int:
        """Cached window blocks whose only reference is their node's. O(1)."""
        return len(self.lru)

    def can_allocate(self, n: int) -> bool:
        """Whether n blocks can be had now (free + evictable). O(1)."""
        return n <= self.pool.num_free + len(self.lru)

    def fits(self, need: int, locked: Sequence[int]) -> bool:
        """Whether need blocks can be had once the blocks ``locked`` (a match's window) are locked. O(len(locked))."""
        idle = sum(b in self.lru for b in locked)
        return need <= self.pool.num_free + len(self.lru) - idle

    def take(self, n: int) -> list[int]:
        """n blocks (ref count 1 each), evicting cached window blocks for the shortfall (check can_allocate first).
        O(n). Raises NoFreeBlocksError: not enough even after eviction (nothing taken)."""
        if not self.can_allocate(n):
            raise NoFreeBlocksError(f"window group: requested {n} blocks, cannot free enough")
        short = n - self.pool.num_free
        if short > 0:
            self.evict(short)
        return self.pool.allocate(n)

    def evict(self, n: int) -> list[int]:
        """Free up to n evictable cached window blocks, least recently released first; their nodes stay in the tree
        without one. Returns them in eviction order. Bumps epoch when any. O(n)."""
        evicted: list[int] = []
        hashes: list[BlockHash] = []
        lru = self.lru
        while lru and len(evicted) < n:
            block, _ = lru.popitem(last=False)
            node = self.block_node[block]
            assert node is not None and node.block_hash is not None
            del self.node_block[node]
            self.block_node[block] = None
            self.pool.decref(block)
            evicted.append(block)
            hashes.append(node.block_hash)
        if evicted:
            self.epoch += 1
            self.num_evicted += len(evicted)
            self.events.removed(hashes, group=GROUP)
        return evicted

    # ----------------------------------------------------------------- references
    def lock(self, blocks: Sequence[int]) -> None:
        """One more reference on each (allocated) block; a cached one stops being evictable. O(len(blocks))."""
        rcs = self.pool.ref_counts
        for b in blocks:
            if rcs[b] == 1 and self.block_node[b] is not None:
                del self.lru[b]
            self.pool.incref(b)

    def unlock(self, blocks: Sequence[int]) -> None:
        """One reference less on each block: a cached one left with its node's only becomes evictable (most recently
        released), any other at 0 goes to the free queue. O(len(blocks))."""
        for b in blocks:
            if self.pool.decref(b) == 1 and self.block_node[b] is not None:
                self.lru[b] = None

    # ----------------------------------------------------------------- sequences
    def add(self, seq_id: int, num_cached_tokens: int, window: Sequence[int], num_new_blocks: int) -> list[int]:
        """Register seq_id's table: NULL before the window of its cached prefix, the cached window blocks (locked
        here), then num_new_blocks new ones (check fits first). Returns the table (the group's own list). O(blocks)."""
        self.lock(window)
        table = [NULL_BLOCK] * self.first_live(num_cached_tokens) + list(window) + self.take(num_new_blocks)
        self.tables[seq_id] = table
        return table

    def grow(self, seq_id: int, num_blocks: int) -> list[int]:
        """Extend seq_id's table to num_blocks entries with new blocks (check can_allocate first); returns them."""
        table = self.tables[seq_id]
        new = self.take(num_blocks - len(table)) if num_blocks > len(table) else []
        table.extend(new)
        return new

    def release_before(self, seq_id: int, num_computed: int) -> None:
        """Drop seq_id's references on the blocks before first_live(num_computed) (NULL_BLOCK in the table from then
        on): cached ones become evictable, the others free. O(blocks released)."""
        table = self.tables[seq_id]
        gone = []
        i = self.first_live(num_computed) - 1
        while i >= 0 and table[i] != NULL_BLOCK:  # the entries before are NULL already
            gone.append(table[i])
            table[i] = NULL_BLOCK
            i -= 1
        gone.reverse()
        self.unlock(gone)

    def cache(self, seq_id: int, start: int, nodes: Sequence[Node]) -> None:
        """Group 0 cached table entries [start, start + len(nodes)) of seq_id as nodes: each node without a window
        block takes the sequence's live one (one more reference). O(len(nodes))."""
        table = self.tables[seq_id]
        rcs = self.pool.ref_counts
        taken: list[Node] = []
        for i, node in enumerate(nodes, start):
            b = table[i]
            if b == NULL_BLOCK or node in self.node_block or self.block_node[b] is not None:
                continue
            rcs[b] += 1  # the node's reference; >= 2, so not evictable
            self.node_block[node] = b
            self.block_node[b] = node
            taken.append(node)
        if taken and self.events.enabled:
            self._stored(taken)

    def _stored(self, nodes: list[Node]) -> None:
        """Record BlockStored (group 1) for nodes that took window blocks, each with its parent. O(len(nodes))."""
        hashes = [n.block_hash for n in nodes if n.block_hash is not None]
        parents = [n.parent.block_hash if n.parent is not None else None for n in nodes]
        salts = [salt_under(n.parent) for n in nodes]
        keys = [n.key for n in nodes]
        self.events.stored(
            hashes,
            None,
            self.block_size,
            keys=keys,
            block_parents=parents,
            salts=salts,
            group=GROUP,
            sliding_window=self.window,
        )

    def fork(self, parent_id: int, child_id: int) -> None:
        """child_id gets a copy of parent_id's table, one more reference on each live block. O(blocks)."""
        table = list(self.tables[parent_id])
        self.lock([b for b in table if b != NULL_BLOCK])
        self.tables[child_id] = table

    def shared_in(self, seq_id: int, start: int, end: int) -> list[int]:
        """The indices of seq_id's table entries covering positions [start, end) that another holder shares (ref
        count > 1): the ones copy_on_write replaces. O(blocks in range)."""
        table = self.tables[seq_id]
        rcs = self.pool.ref_counts
        bs = self.block_size
        return [i for i in range(start // bs, cdiv(end, bs)) if table[i] != NULL_BLOCK and rcs[table[i]] > 1]

    def copy_on_write(self, seq_id: int, start: int, end: int) -> list[tuple[int, int]]:
        """Give seq_id its own block for each shared (ref count > 1) block covering positions [start, end); the old
        one loses this table's reference. Returns (src, dst) pairs. O(blocks in range). Raises NoFreeBlocksError
        (nothing changed)."""
        table = self.tables[seq_id]
        shared = self.shared_in(seq_id, start, end)
        if not shared:
            return []
        pairs = []
        for i, dst in zip(shared, self.take(len(shared)), strict=True):
            pairs.append((table[i], dst))
            table[i] = dst
        self.unlock([src for src, _ in pairs])
        return pairs

    def free(self, seq_id: int) -> None:
        """Drop seq_id's table and its references (swapped out: its host blocks). O(blocks)."""
        swapped = self.swapped.pop(seq_id, None)
        if swapped is not None:
            for h in swapped.host_blocks:
                self.host_pool.decref(h)
            return
        self.unlock([b for b in self.tables.pop(seq_id) if b != NULL_BLOCK])

    # ----------------------------------------------------------------- swapping
    def can_swap_out(self, seq_id: int) -> bool:
        """Whether the host pool has a block for each live entry of seq_id's table. O(blocks)."""
        return sum(b != NULL_BLOCK for b in self.tables[seq_id]) <= self.host_pool.num_free

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move seq_id's live entries to host blocks (check can_swap_out first): its device references go (cached
        ones become evictable, the others free) and its table leaves ``tables`` for ``swapped``. Returns the
        (device, host) pairs the worker copies before anything of the step writes a device block. O(blocks)."""
        table = self.tables.pop(seq_id)
        live = [b for b in table if b != NULL_BLOCK]
        host = self.host_pool.allocate(len(live))
        self.unlock(live)
        self.swapped[seq_id] = SwappedWindow(len(table), host)
        return list(zip(live, host, strict=True))

    def can_swap_in(self, seq_id: int) -> bool:
        """Whether a device block can be had for each of swapped seq_id's host blocks. O(1)."""
        return self.can_allocate(len(self.swapped[seq_id].host_blocks))

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Bring swapped seq_id back (check can_swap_in first): new device blocks (evicting cached window blocks as
        needed) for its live entries, NULL before them as before, its host blocks freed. Returns the (host, device)
        pairs the worker copies before the forward. O(blocks)."""
        swapped = self.swapped.pop(seq_id)
        device = self.take(len(swapped.host_blocks))
        for h in swapped.host_blocks:
            self.host_pool.decref(h)
        self.tables[seq_id] = [NULL_BLOCK] * (swapped.num_entries - len(device)) + device
        return list(zip(swapped.host_blocks, device, strict=True))

    def forget(self, node: Node) -> None:
        """A tree node left the tree: its window block (if any) loses the node's reference. Bumps epoch. O(1)."""
        b = self.node_block.pop(node, None)
        if b is None:
            return
        self.block_node[b] = None
        self.lru.pop(b, None)
        self.pool.decref(b)
        self.epoch += 1
        if node.block_hash is not None:
            self.events.removed([node.block_hash], group=GROUP)

    def check_invariants(self, num_computed: dict[int, int], is_cached: Callable[[Node], bool]) -> None:
        """Recount from scratch: ref counts (tables + nodes), the node map both ways (every node still cached), the
        LRU (exactly the cached blocks at ref count 1), each table NULL exactly before its window, the host pool's
        blocks each held by one swapped sequence. num_computed: seq_id -> computed tokens of each registered
        sequence. O(blocks + tables). Raises AssertionError."""
        self.pool.check_invariants()
        self.host_pool.check_invariants()
        registered = set(self.tables) | set(self.swapped)
        assert set(num_computed) == registered, f"tables {sorted(registered)} vs {sorted(num_computed)}"
        assert not set(self.tables) & set(self.swapped), "a sequence both live and swapped out"
        host_held = sorted(h for s in self.swapped.values() for h in s.host_blocks)
        host_used = [h for h in range(self.host_pool.num_blocks) if self.host_pool.ref_counts[h]]
        assert host_held == host_used, f"window host blocks held {host_held}, in use {host_used}"
        assert all(self.host_pool.ref_counts[h] == 1 for h in host_used), "a window host block held twice"
        expected = [0] * self.pool.num_blocks
        for seq_id, table in self.tables.items():
            lo = self.first_live(num_computed[seq_id])
            for i, b in enumerate(table):
                assert (b == NULL_BLOCK) == (i < lo), f"seq {seq_id} entry {i} = {b}, window starts at {lo}"
                expected[b] += 1
        for node, b in self.node_block.items():
            assert self.block_node[b] is node, f"window block {b} maps to another node"
            assert is_cached(node), f"window block {b} held by a node no longer in the tree"
            expected[b] += 1
        held = sum(n is not None for n in self.block_node)
        assert held == len(self.node_block), f"{held} blocks map to nodes, {len(self.node_block)} nodes to blocks"
        rcs = self.pool.ref_counts
        for b in range(1, self.pool.num_blocks):
            assert rcs[b] == expected[b], f"window block {b}: ref count {rcs[b]}, {expected[b]} references"
        idle = [b for b in range(1, self.pool.num_blocks) if self.block_node[b] is not None and rcs[b] == 1]
        assert sorted(self.lru) == idle, f"window LRU {sorted(self.lru)} vs idle cached {idle}"
