"""KVCacheManager: per-sequence block tables over a paged KV pool with a radix-tree prefix cache.

The scheduler's view of KV memory (it never sees tensors): which physical blocks each sequence's positions live in
(slot = block_table[p // B] * B + p % B), which full blocks are cached for reuse, and which copies (copy-on-write,
swap) the worker must perform before a step. Design after vLLM's paged attention (Kwon et al., SOSP 2023, sec. 4)
and SGLang's RadixAttention (Zheng et al., 2024, sec. 3).

Admission, in this order (what runtime/scheduler/scheduler.py does):
    keys = manager.block_keys(prompt, cache_salt)    # once per request: packed blocks (radix/keys.py)
    match = manager.match_prefix(keys)               # pure; repeat while waiting (is_current says when to)
    cached = manager.add_sequence(seq_id, match, num_new_tokens=chunk)   # locks that match, no second walk
then per step allocate / prepare_write / commit_computed (/ append_tokens after sampling; release_uncomputed after a
speculative step), and free at the end.

Prefix cache: a RadixTree (radix/tree.py), or with prefix caching off a NoPrefixCache (radix/no_cache.py) that keeps
nothing; the choice is made once, here, and no method asks again. Device blocks, the swap pool and the host tier's
copies come from a BlockSupply part (radix/block_supply.py).

Host tier (num_host_cache_blocks > 0 with prefix caching, radix/host_tier.py): evicted device blocks are written
back to host blocks and stay matchable; add_sequence loads a matched host-only suffix back into new device blocks.
Each step the scheduler puts take_tier_copies() into its ForwardBatch, holds a sequence for which waits_for_loads()
is True out of that step's forward, and calls tier_copies_done() when the step's result arrives.

Reference rules: a block table entry holds one reference; the tree holds one per cached block; when a sequence writes a
block the tree already holds, an idle resident copy is replaced by the sequence's (and freed), while one in use stays
and the sequence also holds a reference on it (its "shadow"), so every sequence references the whole cached path it
stands on, every evictable block is truly reclaimable, and an idle duplicate never costs a second block. A block enters
the tree only from commit_computed / free, i.e. once its KV is written, never at allocation; it is hashed then, once
(radix/tree.py). Methods that cannot be served return None (or raise) with no side effect. B: tokens per block.
"""

from __future__ import annotations

from collections.abc import Sequence

from radix.block_pool import BlockPool, NoFreeBlocksError
from radix.block_supply import BlockSupply
from radix.blocks import cdiv
from radix.events import KvEvent, KvEventLog, KvSnapshot
from radix.hashing import HashFn, blake2b_128
from radix.host_tier import HostTier, TierCopies
from radix.invariants import check_manager
from radix.keys import BlockKeys
from radix.no_cache import NoPrefixCache
from radix.prefix_cache import PrefixCache
from radix.prefix_match import PrefixMatch, StaleMatchError
from radix.sequence import SeqBlocks
from radix.stats import KVStats, count_stats
from radix.tree import RadixTree

__all__ = ["KVCacheManager", "KVStats", "NoFreeBlocksError", "PrefixMatch", "StaleMatchError", "UnknownSequenceError"]


class UnknownSequenceError(KeyError):
    """The seq_id is not registered with the KVCacheManager."""


class KVCacheManager:
    """Block tables, prefix cache and accounting for ``num_blocks`` device KV blocks (+ an optional host pool).

    Args:
        num_blocks: device blocks including the reserved null block 0 (usable: num_blocks - 1), >= 2.
        block_size: tokens per block, >= 1.
        enable_prefix_caching: keep written full blocks in a radix tree and reuse them (False: a NoPrefixCache).
        num_host_blocks: host-memory blocks for swap_out / swap_in (ids 0 .. num_host_blocks - 1), >= 0.
        num_host_cache_blocks: host-tier blocks of the prefix cache (0: no tier; ignored without prefix caching),
            a pool apart from the swap pool; the worker's host KV tensor holds the swap pool's blocks first, then the
            tier's (take_tier_copies offsets the tier's ids by num_host_blocks).
        record_events: keep KV events (radix/events.py) for drain_events; only an owner that drains them (the
            scheduler process, which publishes them) should ask: a bounded ring of DEFAULT_EVENT_CAPACITY events
            whose overflow drops the oldest, seen by the consumer as a seq gap. Off: no event is made at all.
        event_token_ids: each BlockStored event also carries its blocks' packed tokens (radix/events.py).
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
        event_token_ids: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_blocks < 0 or num_host_cache_blocks < 0:
            raise ValueError(f"host block counts must be >= 0, got {num_host_blocks}, {num_host_cache_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self._pool = BlockPool(num_blocks)
        self._host_pool = BlockPool(num_host_blocks, reserve_null=False)
        self._events = KvEventLog(enabled=record_events, token_ids=event_token_ids)
        self._tier: HostTier | None = None
        self._cache: PrefixCache
        if enable_prefix_caching:
            if num_host_cache_blocks:
                self._tier = HostTier(num_host_cache_blocks)
            self._cache = RadixTree(self._pool, block_size, hash_fn, self._events, self._tier)
        else:
            self._cache = NoPrefixCache(self._pool, block_size)
        self._supply = BlockSupply(self._pool, self._cache, self._host_pool, self._tier)
        self._seqs: dict[int, SeqBlocks] = {}
        self._queries_tokens = 0
        self._hits_tokens = 0
        self._host_hits_tokens = 0

    # ----------------------------------------------------------------- admission and growth
    def block_keys(self, token_ids: Sequence[int], cache_salt: str | None = None) -> BlockKeys:
        """The per-block keys of token_ids for this manager's block size (radix/keys.py): compute once per request
        and reuse for every match_prefix. Without prefix caching they have no chain ids (nothing to wait for in
        flight). Pure, O(len(token_ids)). Raises ValueError for a bad token id."""
        return self._cache.block_keys(token_ids, cache_salt)

    def match_prefix(self, keys: BlockKeys) -> PrefixMatch:
        """Longest cached block-aligned prefix of keys on either tier (device blocks, then host-only ones), capped at
        keys.num_tokens - 1 tokens so the last token is computed, within keys.salt's subtree.

        Pure lookup: takes no reference, hashes nothing; one dict probe per matched block, O(matched blocks). The
        result is valid until the next eviction (see PrefixMatch); hand it to add_sequence to lock it.
        Raises ValueError: keys made for another block size.
        """
        if keys.block_size != self.block_size:
            raise ValueError(f"keys of block size {keys.block_size}, manager has {self.block_size}")
        cache = self._cache
        if not keys.num_tokens:
            return PrefixMatch([], 0, keys, None, cache.epoch)
        found = cache.match(keys.blocks, keys.salt, (keys.num_tokens - 1) // self.block_size)
        num_tokens = (len(found.block_ids) + len(found.host_nodes)) * self.block_size
        return PrefixMatch(found.block_ids, num_tokens, keys, found.last_node, cache.epoch, found.host_nodes)

    def is_current(self, match: PrefixMatch) -> bool:
        """Whether match's blocks are still where it says (no eviction / uncache / reset / load-back since it was
        taken). O(1)."""
        return match.epoch == self._cache.epoch

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
        cache = self._cache
        if match.epoch != cache.epoch:
            raise StaleMatchError(f"match taken at epoch {match.epoch}, the tree is at {cache.epoch}")
        cached = match.num_tokens
        block_ids = match.block_ids
        host_nodes = match.host_nodes
        n_new = num_tokens - cached if num_new_tokens is None else num_new_tokens
        if n_new < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {n_new}")
        need = cdiv(cached + n_new, self.block_size) - len(block_ids)
        if not self._supply.fits(need, block_ids):
            return None
        cache.lock(block_ids)
        cache.pin_for_load(host_nodes)  # before the eviction that makes room, which must not drop them
        new = self._supply.take(need)
        cache.load_back(host_nodes, new[: len(host_nodes)])
        if host_nodes:  # the load's own references on its path, until its copy lands
            self._supply.hold_loads(block_ids + new[: len(host_nodes)])
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
        if not self._supply.can_allocate(need):
            return None
        blocks = self._supply.take(need)
        seq.block_table.extend(blocks)
        return blocks

    def append_tokens(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Record sampled tokens as known tokens of the sequence (their KV is written by a later step); each block
        they fill is packed now, once. O(len(token_ids) + B). Raises UnknownSequenceError, ValueError (a bad token
        id; nothing recorded)."""
        self._get(seq_id).append_tokens(token_ids, self.block_size)

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
        return self._supply.copy_on_write(seq.block_table, shared)

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
        self._cache.cache_full_blocks(seq, num_tokens // self.block_size)

    def release_uncomputed(self, seq_id: int) -> list[int]:
        """Speculative decoding's rollback: the table entries past cdiv(num_computed_tokens, block_size) (slots of
        rejected draft tokens) leave it, each losing this sequence's reference (BlockSupply.release_tail).
        Returns the released block ids. O(released * log n). Raises UnknownSequenceError, ValueError (swapped out)."""
        seq = self._live(seq_id)
        return self._supply.release_tail(seq.block_table, cdiv(seq.num_computed, self.block_size))

    def fork(self, parent_id: int, child_id: int) -> None:
        """Register child_id as a copy of parent_id (parallel sampling): same tokens, same block table, every
        referenced block's ref count + 1. O(blocks). Raises UnknownSequenceError, ValueError (child exists,
        parent swapped out)."""
        parent = self._live(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} is already registered")
        child = parent.copy()
        self._cache.lock(child.block_table + child.shadow)
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
            self._supply.release_swapped(seq)
            return
        cache = self._cache
        limit = seq.num_computed if keep_tokens is None else min(seq.num_computed, keep_tokens)
        cache.cache_full_blocks(seq, limit // self.block_size)
        if keep_tokens is not None:
            cache.uncache_past(seq, keep_tokens // self.block_size)
        cache.unlock(seq.block_table + seq.shadow)

    # ----------------------------------------------------------------- swapping and host tier copies
    def swap_out(self, seq_id: int) -> list[tuple[int, int]] | None:
        """Preempt by swapping (radix/swap.py): every table block gets a host block, device references go.

        Returns (device, host) pairs the worker copies before anything overwrites them (in the same step), or None
        with no side effect when the host pool lacks room. O(blocks * log n). Raises ValueError if already swapped.
        """
        return self._supply.swap_out(self._live(seq_id))

    def swap_in(self, seq_id: int) -> list[tuple[int, int]] | None:
        """Bring a swapped sequence back (radix/swap.py): new device blocks (evicting as needed), host blocks
        released. Returns (host, device) pairs the worker copies before the step, or None with no side effect when
        the device lacks room. O(blocks * log n). Raises ValueError if the sequence is not swapped out.
        """
        seq = self._get(seq_id)
        if seq.host_table is None:
            raise ValueError(f"sequence {seq_id} is not swapped out")
        return self._supply.swap_in(seq)

    def waits_for_loads(self, seq_id: int) -> bool:
        """Whether a block of the sequence's cached prefix is still being loaded back (its copy is in the step
        being planned or in flight): attention must not read it, so the sequence stays out of this step's forward.
        O(cached blocks). Raises UnknownSequenceError, ValueError (swapped out)."""
        return self._supply.waits_for_loads(self._live(seq_id))

    def take_tier_copies(self) -> TierCopies:
        """The write-back (device, host) and load-back (host, device) pairs scheduled since the last call, host ids
        as the worker's (after its num_host_blocks swap blocks), for this step's ForwardBatch swap_out / swap_in.
        Their blocks stay pinned until tier_copies_done. O(copies)."""
        return self._supply.take_tier_copies()

    def tier_copies_done(self) -> None:
        """The worker ran the step that carried the taken copies: release the loads' device references (a block
        nobody else holds becomes evictable, or free), unpin the host blocks, end the loads. O(pins * log n)."""
        self._supply.tier_copies_done()

    # ----------------------------------------------------------------- queries
    def num_free_blocks(self) -> int:
        """Blocks on the free queue. O(1)."""
        return self._pool.num_free

    def num_evictable_blocks(self) -> int:
        """Cached blocks referenced only by the tree. O(1)."""
        return self._cache.num_evictable

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether num_blocks new blocks can be handed out now (free + evictable >= num_blocks). O(1)."""
        return self._supply.can_allocate(num_blocks)

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table (empty while swapped out). O(blocks)."""
        return list(self._get(seq_id).block_table)

    def num_computed_tokens(self, seq_id: int) -> int:
        """Tokens whose KV is written (cached prefix included). O(1)."""
        return self._get(seq_id).num_computed

    def stats(self) -> KVStats:
        """Current counters. O(sequences)."""
        return count_stats(
            self._pool,
            self._cache,
            self._host_pool,
            self._seqs.values(),
            self.block_size,
            self._queries_tokens,
            self._hits_tokens,
            self._supply.num_evicted,
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
        return KvSnapshot(self._events.last_seq, self._cache.hashes(), self._cache.host_hashes())

    @property
    def tree(self) -> PrefixCache:
        """The prefix cache: a RadixTree, or a NoPrefixCache when built without prefix caching (read-only use:
        lru_order, block_hash; evict and clear for tests and benchmarks). O(1)."""
        return self._cache

    def check_invariants(self) -> None:
        """Recount everything from scratch: exact ref counts (tables + shadows + tree), each block exactly one of
        free / evictable / in use, per-sequence bounds and cached paths, host pool ownership, and the prefix cache's
        own state (the tree and the host tier). O(blocks + sequences * table). For tests: far too slow for the serving
        loop.

        Raises:
            AssertionError: with a message naming the sequence or block.
        """
        pins = self._supply.device_pins
        check_manager(self._pool, self._cache, self._host_pool, self._seqs, self.block_size, pins)

    def _get(self, seq_id: int) -> SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"unknown sequence {seq_id}")
        return seq

    def _live(self, seq_id: int) -> SeqBlocks:
        seq = self._get(seq_id)
        if seq.host_table is not None:
            raise ValueError(f"sequence {seq_id} is swapped out")
        return seq
