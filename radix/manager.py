"""KVCacheManager: per-sequence block tables over a paged KV pool with a radix-tree prefix cache.

The scheduler's view of KV memory (it never sees tensors): which physical blocks each sequence's positions live in
(slot = block_table[p // B] * B + p % B), which full blocks are cached for reuse, and which copies (copy-on-write,
swap) the worker must perform before a step. Design after vLLM's paged attention (Kwon et al., SOSP 2023, sec. 4)
and SGLang's RadixAttention (Zheng et al., 2024, sec. 3).

Admission, in this order (what runtime/scheduler/scheduler.py does):
    keys = manager.block_keys(prompt, cache_salt)    # once per request: packed blocks (radix/keys.py)
    match = manager.match_prefix(keys)               # pure; repeat while waiting (is_current says when to)
    cached = manager.add_sequence(seq_id, match, num_new_tokens=chunk)   # locks that match, no second walk
then per step allocate / prepare_write / commit_computed (/ append_tokens after sampling), and free at the end.

Host tier (num_host_cache_blocks > 0, radix/host_tier.py): evicted device blocks are written back to host blocks and
stay matchable; add_sequence loads a matched host-only suffix back into new device blocks. Each step the scheduler
puts take_tier_copies() into its ForwardBatch, holds a sequence for which waits_for_loads() is True out of that
step's forward, and calls tier_copies_done() when the step's result arrives.

Reference rules: a block table entry holds one reference; the tree holds one per cached block; when a sequence
writes a block the tree already holds, an idle resident copy is replaced by the sequence's (and freed), while one in
use stays and the sequence also holds a reference on it (its "shadow"), so every sequence references the whole cached
path it stands on, every evictable block is truly reclaimable, and an idle duplicate never costs a second block.
A block enters the tree only from commit_computed / free, i.e. once its KV is written, never at allocation; it is
hashed then, once (radix/tree.py). Methods that cannot be served return None (or raise) with no side effect.
Complexities assume B tokens per block.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from radix.block_pool import BlockPool, NoFreeBlocksError
from radix.block_supply import BlockSupply, UnknownSequenceError
from radix.blocks import cdiv
from radix.events import KvEvent, KvEventLog, KvSnapshot
from radix.hashing import HashFn, blake2b_128
from radix.host_tier import HostTier
from radix.invariants import check_host_tier, check_manager
from radix.keys import BlockKeys, pack_blocks
from radix.prefix_match import PrefixMatch, StaleMatchError
from radix.sequence import SeqBlocks
from radix.stats import KVStats, count_stats
from radix.swap import release_host
from radix.tree import RadixTree

logger = logging.getLogger(__name__)

__all__ = [
    "KVCacheManager",
    "KVStats",
    "NoFreeBlocksError",
    "PrefixMatch",
    "StaleMatchError",
    "UnknownSequenceError",
]


class KVCacheManager(BlockSupply):
    """Block tables, prefix cache and accounting for ``num_blocks`` device KV blocks (+ an optional host pool).

    Args:
        num_blocks: device blocks including the reserved null block 0 (usable: num_blocks - 1), >= 2.
        block_size: tokens per block, >= 1.
        enable_prefix_caching: keep written full blocks in the radix tree and reuse them.
        num_host_blocks: host-memory blocks for swap_out / swap_in (ids 0 .. num_host_blocks - 1), >= 0.
        num_host_cache_blocks: host-tier blocks of the prefix cache (0: no tier; ignored without prefix caching),
            a pool apart from the swap pool; the worker's host KV tensor holds the swap pool's blocks first, then the
            tier's (take_tier_copies offsets the tier's ids by num_host_blocks).
        record_events: keep KV events (radix/events.py) for drain_events; only an owner that drains them (the
            scheduler process, which publishes them) should ask: a bounded ring of DEFAULT_EVENT_CAPACITY events
            whose overflow drops the oldest, seen by the consumer as a seq gap. Off: no event is made at all.
        hash_fn: block digest (default BLAKE2b-128); tests inject a weak one to force collisions.
    Raises:
        ValueError: bad sizes.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        *,
        record_events: bool = False,
        hash_fn: HashFn = blake2b_128,
        num_host_cache_blocks: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_blocks < 0 or num_host_cache_blocks < 0:
            raise ValueError(f"host block counts must be >= 0, got {num_host_blocks}, {num_host_cache_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_host_blocks = num_host_blocks
        self._pool = BlockPool(num_blocks)
        self._host_pool = BlockPool(num_host_blocks, reserve_null=False)
        self._events = KvEventLog(enabled=record_events and enable_prefix_caching)
        tier = HostTier(num_host_cache_blocks) if num_host_cache_blocks and enable_prefix_caching else None
        self._tier = tier
        self._tree = RadixTree(self._pool, block_size, hash_fn, self._events, tier)
        self._seqs: dict[int, SeqBlocks] = {}
        self._queries_tokens = 0
        self._hits_tokens = 0
        self._host_hits_tokens = 0
        self._evicted_blocks = 0

    # ----------------------------------------------------------------- admission and growth
    def block_keys(self, token_ids: Sequence[int], cache_salt: str | None = None) -> BlockKeys:
        """The per-block keys of token_ids for this manager's block size (radix/keys.py): compute once per request
        and reuse for every match_prefix. Pure, O(len(token_ids)). Raises ValueError for a bad token id."""
        return BlockKeys(token_ids, self.block_size, cache_salt)

    def match_prefix(self, keys: BlockKeys) -> PrefixMatch:
        """Longest cached block-aligned prefix of keys on either tier (device blocks, then host-only ones), capped at
        keys.num_tokens - 1 tokens so the last token is computed, within keys.salt's subtree.

        Pure lookup: takes no reference, hashes nothing; one dict probe per matched block, O(matched blocks). The
        result is valid until the next eviction (see PrefixMatch); hand it to add_sequence to lock it.
        Raises ValueError: keys made for another block size.
        """
        if keys.block_size != self.block_size:
            raise ValueError(f"keys of block size {keys.block_size}, manager has {self.block_size}")
        tree = self._tree
        if not self.enable_prefix_caching or not keys.num_tokens:
            return PrefixMatch([], 0, keys, None, tree.epoch)
        found = tree.match(keys.blocks, keys.salt, (keys.num_tokens - 1) // self.block_size)
        num_tokens = (len(found.block_ids) + len(found.host_nodes)) * self.block_size
        return PrefixMatch(found.block_ids, num_tokens, keys, found.last_node, tree.epoch, found.host_nodes)

    def is_current(self, match: PrefixMatch) -> bool:
        """Whether match's blocks are still where it says (no eviction / uncache / reset / load-back since it was
        taken). O(1)."""
        return match.epoch == self._tree.epoch

    def add_sequence(
        self, seq_id: int, match: PrefixMatch, num_new_tokens: int | None = None, *, count_stats: bool = True
    ) -> int | None:
        """Admit the sequence match.keys describes, all or nothing: lock match's device blocks (no second match),
        allocate device blocks for its host-only blocks (loaded back: see waits_for_loads) and for num_new_tokens
        more tokens (default: the rest of the sequence), evicting LRU leaves as needed.

        Sets num_computed_tokens to match.num_tokens (both tiers) and returns it; returns None with no side effect
        when the blocks do not fit. Counts prefix_queries_tokens / prefix_hits_tokens (and host hits) when
        count_stats. The sequence keeps its own copy of match.keys' blocks (O(blocks) pointers), so nothing is
        packed or hashed again. O(matched blocks + new blocks * log n).

        Raises:
            StaleMatchError: match was taken before an eviction / uncache / reset (take a new one).
            ValueError: seq_id already registered, empty sequence, or num_new_tokens < 0.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already registered")
        keys = match.keys
        num_tokens = keys.num_tokens
        if not num_tokens:
            raise ValueError("token_ids must not be empty")
        if match.epoch != self._tree.epoch:
            raise StaleMatchError(f"match taken at epoch {match.epoch}, the tree is at {self._tree.epoch}")
        cached, block_ids, host_nodes = match.num_tokens, match.block_ids, match.host_nodes
        n_new = num_tokens - cached if num_new_tokens is None else num_new_tokens
        if n_new < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {n_new}")
        need = cdiv(cached + n_new, self.block_size) - len(block_ids)
        free = self._pool.num_free
        if need > free:  # eviction needed: the matched blocks that are idle now cannot be evicted for this
            rcs = self._pool.ref_counts
            idle_matched = sum(rcs[b] == 1 for b in block_ids)
            if need > free + self._tree.num_evictable - idle_matched:
                return None
        self._tree.lock(block_ids)
        self._tree.pin_for_load(host_nodes)  # before the eviction that makes room, which must not drop them
        new = self._take_blocks(need)
        self._tree.load_back(host_nodes, new[: len(host_nodes)])
        if host_nodes and self._tier is not None:  # the load's own references on its path, until its copy lands
            path = block_ids + new[: len(host_nodes)]
            self._tree.lock(path)
            self._tier.device_pins.extend(path)
        seq = SeqBlocks(list(keys.blocks), list(keys.tail), num_tokens, block_ids + new, cached, keys.salt)
        seq.num_cached_blocks = len(block_ids) + len(host_nodes)
        seq.cached_node = match.last_node
        self._seqs[seq_id] = seq
        if count_stats:
            self._queries_tokens += num_tokens
            self._hits_tokens += cached
            self._host_hits_tokens += match.num_host_tokens
        return cached

    def allocate(self, seq_id: int, num_new_tokens: int) -> list[int] | None:
        """Grow the block table to cover num_computed_tokens + num_new_tokens slots, evicting LRU leaves as needed.

        Returns the block ids appended (possibly []), or None with no side effect when even eviction cannot serve.
        O(new blocks * log n). Raises ValueError (num_new_tokens < 0, swapped out), UnknownSequenceError.
        """
        seq = self._live(seq_id)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        need = cdiv(seq.num_computed + num_new_tokens, self.block_size) - len(seq.block_table)
        if need <= 0:
            return []
        if not self.can_allocate(need):
            return None
        blocks = self._take_blocks(need)
        seq.block_table.extend(blocks)
        return blocks

    def append_tokens(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Record sampled tokens as known tokens of the sequence (their KV is written by a later step); each block
        they fill is packed now, once. O(len(token_ids) + B). Raises UnknownSequenceError, ValueError (a bad token
        id; nothing recorded)."""
        seq = self._get(seq_id)
        tail, bs = seq.tail, self.block_size
        if len(tail) + len(token_ids) < bs:
            tail.extend(token_ids)
        else:
            tokens = tail + list(token_ids)
            full = len(tokens) // bs * bs
            seq.blocks.extend(pack_blocks(tokens[:full], bs))
            seq.tail = tokens[full:]
        seq.num_tokens += len(token_ids)

    def prepare_write(self, seq_id: int, start: int, end: int) -> list[tuple[int, int]]:
        """Copy-on-write before writing positions [start, end): each covering block with ref count > 1 is replaced
        in this sequence's table by a new block (the old one loses this sequence's reference).

        Returns (src, dst) block pairs the worker copies before the step. O(blocks in range).
        Raises:
            ValueError: range outside the block table, or inside the cached prefix; swapped out.
            NoFreeBlocksError: not enough blocks even after eviction (nothing changed; check can_allocate first).
        """
        seq = self._live(seq_id)
        bs = self.block_size
        if not 0 <= start <= end <= len(seq.block_table) * bs:
            raise ValueError(f"write range [{start}, {end}) outside the block table ({len(seq.block_table)} blocks)")
        if start < seq.num_cached_blocks * bs and start < end:
            raise ValueError(f"write at {start} inside the cached prefix ({seq.num_cached_blocks * bs} tokens)")
        rc = self._pool.ref_counts
        shared = [i for i in range(start // bs, cdiv(end, bs)) if rc[seq.block_table[i]] > 1]
        if not shared:
            return []
        if not self.can_allocate(len(shared)):
            raise NoFreeBlocksError(f"copy-on-write needs {len(shared)} blocks, cannot free enough")
        pairs = []
        for i, dst in zip(shared, self._take_blocks(len(shared)), strict=True):
            pairs.append((seq.block_table[i], dst))
            seq.block_table[i] = dst
        self._tree.unlock([src for src, _ in pairs])
        return pairs

    def commit_computed(self, seq_id: int, num_tokens: int) -> None:
        """The step that wrote KV for positions < num_tokens finished: set num_computed_tokens and insert every
        newly full block into the tree (de-duplicating against resident blocks). O(new full blocks * B).

        Raises:
            ValueError: num_tokens below num_computed_tokens, above the known tokens or the block table; swapped out.
        """
        seq = self._live(seq_id)
        limit = min(seq.num_tokens, len(seq.block_table) * self.block_size)
        if not seq.num_computed <= num_tokens <= limit:
            raise ValueError(f"commit of {num_tokens} tokens outside [{seq.num_computed}, {limit}]")
        seq.num_computed = num_tokens
        if self.enable_prefix_caching:
            seq.cache_full_blocks(self._tree, num_tokens // self.block_size)

    def fork(self, parent_id: int, child_id: int) -> None:
        """Register child_id as a copy of parent_id (parallel sampling): same tokens, same block table, every
        referenced block's ref count + 1. O(blocks). Raises UnknownSequenceError, ValueError (child exists,
        parent swapped out)."""
        parent = self._live(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} is already registered")
        child = parent.copy()
        self._tree.lock(child.block_table + child.shadow)
        self._seqs[child_id] = child

    def free(self, seq_id: int, keep_tokens: int | None = None) -> None:
        """Finish a sequence: insert its full computed blocks (none past keep_tokens: a stop string ended the text
        there; blocks past it that this sequence alone cached are taken out again), then release its references
        (private blocks return to the free queue; cached ones become evictable). O(blocks * log n).

        Raises:
            UnknownSequenceError; ValueError for keep_tokens < 0.
        """
        seq = self._get(seq_id)
        if keep_tokens is not None and keep_tokens < 0:
            raise ValueError(f"keep_tokens must be >= 0, got {keep_tokens}")
        del self._seqs[seq_id]
        if seq.host_table is not None:
            release_host(seq, self._host_pool)
            return
        if self.enable_prefix_caching:
            limit = seq.num_computed if keep_tokens is None else min(seq.num_computed, keep_tokens)
            seq.cache_full_blocks(self._tree, limit // self.block_size)
            if keep_tokens is not None:
                seq.uncache_past(self._tree, keep_tokens // self.block_size)
        self._tree.unlock(seq.block_table + seq.shadow)

    # ----------------------------------------------------------------- queries
    def num_free_blocks(self) -> int:
        """Blocks on the free queue."""
        return self._pool.num_free

    def num_evictable_blocks(self) -> int:
        """Cached blocks referenced only by the tree."""
        return self._tree.num_evictable

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table (empty while swapped out)."""
        return list(self._get(seq_id).block_table)

    def num_computed_tokens(self, seq_id: int) -> int:
        """Tokens whose KV is written (cached prefix included)."""
        return self._get(seq_id).num_computed

    def stats(self) -> KVStats:
        """Current counters. O(sequences)."""
        return count_stats(
            self._pool,
            self._tree,
            self._host_pool,
            self._seqs.values(),
            self.block_size,
            self._queries_tokens,
            self._hits_tokens,
            self._evicted_blocks,
            self._host_hits_tokens,
            self._tier,
        )

    def drain_events(self) -> list[KvEvent]:
        """KV events since the last drain, oldest first; seq numbers consecutive unless the ring overflowed since
        (then the first one skips the dropped numbers). [] when not record_events. O(events)."""
        return self._events.drain()

    def kv_snapshot(self) -> KvSnapshot:
        """Hashes of the cached blocks on the device and on the host tier (insertion order) and the last event seq
        they reflect (events not yet drained included). O(cached blocks)."""
        return KvSnapshot(self._events.last_seq, self._tree.hashes(), self._tree.host_hashes())

    @property
    def tree(self) -> RadixTree:
        """The radix tree (read-only use: lru_order, block_hash; evict and clear for tests and benchmarks)."""
        return self._tree

    def check_invariants(self) -> None:
        """Recount everything from scratch: exact ref counts (tables + shadows + tree), each block exactly one of
        free / evictable / in use, per-sequence bounds and cached paths, host pool ownership.
        O(blocks + sequences * table). For tests: far too slow for the serving loop.

        Raises:
            AssertionError: with a message naming the sequence or block.
        """
        pins = self._tier.device_pins if self._tier is not None else []
        check_manager(self._pool, self._tree, self._host_pool, self._seqs, self.block_size, pins)
        if self._tier is not None:
            check_host_tier(self._tier, self._tree)
