"""KVCacheManager: per-sequence block tables over a paged KV pool with a radix-tree prefix cache.

The scheduler's view of KV memory (it never sees tensors): which physical blocks each sequence's positions live in
(slot = block_table[p // B] * B + p % B), which full blocks are cached for reuse, and which copies (copy-on-write,
swap) the worker must perform before a step. Design after vLLM's paged attention (Kwon et al., SOSP 2023, sec. 4)
and SGLang's RadixAttention (Zheng et al., 2024, sec. 3).

Reference rules: a block table entry holds one reference; the tree holds one per cached block; a sequence that
reuses a resident duplicate of one of its own blocks also holds a reference on the resident block (its "shadow"), so
every sequence references the whole cached path it stands on and every evictable block is truly reclaimable.
A block enters the tree only from commit_computed / free, i.e. once its KV is written, never at allocation.
Methods that cannot be served return None (or raise) with no side effect. Complexities assume B tokens per block.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from radix.block_pool import BlockPool, NoFreeBlocksError
from radix.events import KvEvent, KvEventLog, KvSnapshot
from radix.hashing import BlockHash, HashFn, blake2b_128, block_key, extra_keys_for_block, hash_block
from radix.sequence import SeqState
from radix.tree import RadixTree

logger = logging.getLogger(__name__)

__all__ = ["KVCacheManager", "KVStats", "NoFreeBlocksError", "PrefixMatch", "UnknownSequenceError"]


class UnknownSequenceError(KeyError):
    """The seq_id is not registered with the KVCacheManager."""


class PrefixMatch(NamedTuple):
    """Cached prefix of a prompt: block ids (root first) and num_tokens = len(block_ids) * block_size."""

    block_ids: list[int]
    num_tokens: int


class KVStats(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """KV usage counters. Blocks exclude the null block; free + evictable + in_use == total.

    cached_blocks: blocks in the radix tree (evictable or not). prefix_*_tokens: prompt tokens looked up / found
    cached at admission. waste_slots: allocated slots minus known tokens, over live (not swapped) sequences.
    """

    total_blocks: int
    free_blocks: int
    evictable_blocks: int
    in_use_blocks: int
    cached_blocks: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    waste_slots: int
    num_sequences: int
    num_swapped: int
    host_total_blocks: int
    host_free_blocks: int

    @property
    def hit_rate(self) -> float:
        """prefix_hits_tokens / prefix_queries_tokens (0.0 before any query)."""
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables, prefix cache and accounting for ``num_blocks`` device KV blocks (+ an optional host pool).

    Args:
        num_blocks: device blocks including the reserved null block 0 (usable: num_blocks - 1), >= 2.
        block_size: tokens per block, >= 1.
        enable_prefix_caching: keep written full blocks in the radix tree and reuse them.
        num_host_blocks: host-memory blocks for swap_out / swap_in (ids 0 .. num_host_blocks - 1), >= 0.
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
        hash_fn: HashFn = blake2b_128,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_host_blocks = num_host_blocks
        self._hash_fn = hash_fn
        self._pool = BlockPool(num_blocks)
        self._host_pool = BlockPool(num_host_blocks, reserve_null=False)
        self._events = KvEventLog(enabled=enable_prefix_caching)
        self._tree = RadixTree(self._pool, block_size, hash_fn, self._events)
        self._seqs: dict[int, SeqState] = {}
        self._queries_tokens = 0
        self._hits_tokens = 0

    # ----------------------------------------------------------------- admission and growth
    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PrefixMatch:
        """Longest cached block-aligned prefix, capped at len(token_ids) - 1 tokens so the last token is computed.

        Pure lookup: takes no reference; the blocks may be evicted before use unless add_sequence locks them.
        Tokens are compared on every hash hit. O(matched tokens).
        """
        if not self.enable_prefix_caching or not token_ids:
            return PrefixMatch([], 0)
        max_blocks = (len(token_ids) - 1) // self.block_size
        block_ids = self._tree.match(token_ids, extra_keys_for_block(0, cache_salt), max_blocks).block_ids
        return PrefixMatch(block_ids, len(block_ids) * self.block_size)

    def add_sequence(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        num_new_tokens: int | None = None,
        *,
        count_stats: bool = True,
    ) -> int | None:
        """Admit a sequence, all or nothing: lock its cached prefix, allocate blocks for ``num_new_tokens`` more
        tokens (default: the rest of token_ids), evicting LRU leaves as needed.

        Sets num_computed_tokens to the cached token count and returns it; returns None with no side effect when the
        blocks do not fit. Counts prefix_queries_tokens / prefix_hits_tokens when count_stats.
        O(len(token_ids) + new blocks * log n).

        Raises:
            ValueError: seq_id already registered, empty token_ids, or num_new_tokens < 0.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already registered")
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        tree = self._tree
        max_blocks = (len(token_ids) - 1) // self.block_size if self.enable_prefix_caching else 0
        match = tree.match(token_ids, extra_keys_for_block(0, cache_salt), max_blocks)
        cached = len(match.block_ids) * self.block_size
        n_new = len(token_ids) - cached if num_new_tokens is None else num_new_tokens
        if n_new < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {n_new}")
        need = _cdiv(cached + n_new, self.block_size) - len(match.block_ids)
        idle_matched = sum(self._pool.ref_counts[b] == 1 for b in match.block_ids)
        if need > self._pool.num_free + tree.num_evictable - idle_matched:
            return None
        tree.lock(match.block_ids)
        seq = SeqState(list(token_ids), match.block_ids + self._take_blocks(need), cached, cache_salt)
        seq.block_hashes = match.block_hashes
        seq.num_cached_blocks = len(match.block_ids)
        self._seqs[seq_id] = seq
        if count_stats:
            self._queries_tokens += len(token_ids)
            self._hits_tokens += cached
        return cached

    def allocate(self, seq_id: int, num_new_tokens: int) -> list[int] | None:
        """Grow the block table to cover num_computed_tokens + num_new_tokens slots, evicting LRU leaves as needed.

        Returns the block ids appended (possibly []), or None with no side effect when even eviction cannot serve.
        O(new blocks * log n). Raises ValueError (num_new_tokens < 0, swapped out), UnknownSequenceError.
        """
        seq = self._live(seq_id)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        need = _cdiv(seq.num_computed + num_new_tokens, self.block_size) - len(seq.block_table)
        if need <= 0:
            return []
        if not self.can_allocate(need):
            return None
        blocks = self._take_blocks(need)
        seq.block_table.extend(blocks)
        return blocks

    def append_tokens(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Record sampled tokens as known tokens of the sequence (their KV is written by a later step). O(len)."""
        self._get(seq_id).token_ids.extend(token_ids)

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
        shared = [i for i in range(start // bs, _cdiv(end, bs)) if rc[seq.block_table[i]] > 1]
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
        limit = min(len(seq.token_ids), len(seq.block_table) * self.block_size)
        if not seq.num_computed <= num_tokens <= limit:
            raise ValueError(f"commit of {num_tokens} tokens outside [{seq.num_computed}, {limit}]")
        seq.num_computed = num_tokens
        self._cache_full_blocks(seq, num_tokens // self.block_size)

    def cache_computed_blocks(self, seq_id: int, num_tokens: int) -> None:
        """Insert the full blocks among the first num_tokens tokens (all computed) into the tree without moving
        num_computed_tokens; commit_computed does this itself. O(new full blocks * B).

        Raises:
            ValueError: num_tokens above num_computed_tokens; swapped out.
        """
        seq = self._live(seq_id)
        if not 0 <= num_tokens <= seq.num_computed:
            raise ValueError(f"cannot cache {num_tokens} tokens: only {seq.num_computed} are computed")
        self._cache_full_blocks(seq, num_tokens // self.block_size)

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
            for host_block in seq.host_table:
                self._host_pool.decref(host_block)
            return
        limit = seq.num_computed if keep_tokens is None else min(seq.num_computed, keep_tokens)
        self._cache_full_blocks(seq, limit // self.block_size)
        if keep_tokens is not None:
            self._uncache_past(seq, keep_tokens // self.block_size)
        self._tree.unlock(seq.block_table + seq.shadow)

    # ----------------------------------------------------------------- swapping
    def swap_out(self, seq_id: int) -> list[tuple[int, int]] | None:
        """Preempt by swapping: give every block of the table a host block and release the device references.

        Returns (device, host) pairs the worker copies before anything overwrites them (in the same step), or None
        with no side effect when the host pool lacks room. O(blocks * log n). Raises ValueError if already swapped.
        """
        seq = self._live(seq_id)
        if len(seq.block_table) > self._host_pool.num_free:
            return None
        host = self._host_pool.allocate(len(seq.block_table))
        pairs = list(zip(seq.block_table, host, strict=True))
        self._tree.unlock(seq.block_table + seq.shadow)
        seq.host_table, seq.block_table, seq.shadow = host, [], []
        seq.block_hashes, seq.num_cached_blocks = [], 0
        return pairs

    def swap_in(self, seq_id: int) -> list[tuple[int, int]] | None:
        """Bring a swapped sequence back: new device blocks (evicting as needed), host blocks released.

        Returns (host, device) pairs the worker copies before the step, or None with no side effect when the device
        lacks room. Its full blocks re-enter the tree (de-duplicated) at the next commit_computed or free.
        O(blocks * log n). Raises ValueError if the sequence is not swapped out.
        """
        seq = self._get(seq_id)
        if seq.host_table is None:
            raise ValueError(f"sequence {seq_id} is not swapped out")
        if not self.can_allocate(len(seq.host_table)):
            return None
        device = self._take_blocks(len(seq.host_table))
        pairs = list(zip(seq.host_table, device, strict=True))
        for host_block in seq.host_table:
            self._host_pool.decref(host_block)
        seq.block_table, seq.host_table = device, None
        return pairs

    # ----------------------------------------------------------------- queries
    def can_allocate(self, num_blocks: int) -> bool:
        """Whether num_blocks new blocks can be handed out now (free + evictable >= num_blocks). O(1)."""
        return num_blocks <= self._pool.num_free + self._tree.num_evictable

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

    def num_tokens(self, seq_id: int) -> int:
        """Known tokens of the sequence (prompt + appended)."""
        return len(self._get(seq_id).token_ids)

    def has_sequence(self, seq_id: int) -> bool:
        """Whether seq_id is registered (live or swapped out)."""
        return seq_id in self._seqs

    def is_swapped(self, seq_id: int) -> bool:
        """Whether the sequence is swapped out to the host pool."""
        return self._get(seq_id).host_table is not None

    def ref_count(self, block_id: int) -> int:
        """Ref count of a device block (for tests and debugging)."""
        return self._pool.ref_count(block_id)

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Slots of positions [start, end): table[p // B] * B + p % B. O(end - start).

        Raises ValueError when the range leaves the block table.
        """
        table = self._live(seq_id).block_table
        bs = self.block_size
        if not 0 <= start <= end <= len(table) * bs:
            raise ValueError(f"positions [{start}, {end}) outside the block table ({len(table)} blocks)")
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def stats(self) -> KVStats:
        """Current counters. O(sequences)."""
        free, evictable = self._pool.num_free, self._tree.num_evictable
        total = self._pool.num_usable
        waste = sum(
            max(0, len(s.block_table) * self.block_size - len(s.token_ids))
            for s in self._seqs.values()
            if s.host_table is None
        )
        return KVStats(
            total_blocks=total,
            free_blocks=free,
            evictable_blocks=evictable,
            in_use_blocks=total - free - evictable,
            cached_blocks=self._tree.num_cached,
            prefix_queries_tokens=self._queries_tokens,
            prefix_hits_tokens=self._hits_tokens,
            waste_slots=waste,
            num_sequences=len(self._seqs),
            num_swapped=sum(s.host_table is not None for s in self._seqs.values()),
            host_total_blocks=self.num_host_blocks,
            host_free_blocks=self._host_pool.num_free,
        )

    def drain_events(self) -> list[KvEvent]:
        """KV events since the last drain, oldest first (seq numbers consecutive)."""
        return self._events.drain()

    def snapshot(self) -> list[BlockHash]:
        """Hashes of all resident cached blocks. O(cached blocks)."""
        return self._tree.hashes()

    def kv_snapshot(self) -> KvSnapshot:
        """snapshot() with the last event seq it reflects (events not yet drained included)."""
        return KvSnapshot(self._events.last_seq, self._tree.hashes())

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block if none is in use (emits AllBlocksCleared); else change nothing, return False."""
        return self._tree.clear()

    @property
    def tree(self) -> RadixTree:
        """The radix tree (read-only use: lru_order, is_cached)."""
        return self._tree

    # ----------------------------------------------------------------- internals
    def _get(self, seq_id: int) -> SeqState:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"unknown sequence {seq_id}")
        return seq

    def _live(self, seq_id: int) -> SeqState:
        seq = self._get(seq_id)
        if seq.host_table is not None:
            raise ValueError(f"sequence {seq_id} is swapped out")
        return seq

    def _take_blocks(self, n: int) -> list[int]:
        short = n - self._pool.num_free
        if short > 0:
            self._tree.evict(short)
        return self._pool.allocate(n)

    def _cache_full_blocks(self, seq: SeqState, num_full_blocks: int) -> None:
        start, end = seq.num_cached_blocks, min(num_full_blocks, len(seq.block_table))
        if not self.enable_prefix_caching or end <= start:
            return
        bs, tokens = self.block_size, seq.token_ids
        parent = seq.block_hashes[start - 1] if start else None
        keys, hashes = [], []
        h = parent
        for i in range(start, end):
            key = block_key(tokens[i * bs : (i + 1) * bs], extra_keys_for_block(i, seq.cache_salt))
            h = hash_block(h, key, self._hash_fn)
            keys.append(key)
            hashes.append(h)
        table = seq.block_table
        resident = self._tree.insert_chain(parent, hashes, keys, table[start:end]).resident
        shadow = [r for i, r in enumerate(resident) if r != table[start + i]]
        self._tree.lock(shadow)
        seq.shadow.extend(shadow)
        seq.block_hashes.extend(hashes[: len(resident)])
        seq.num_cached_blocks += len(resident)

    def _uncache_past(self, seq: SeqState, keep_blocks: int) -> None:
        rc, tree = self._pool.ref_counts, self._tree
        own = []  # blocks past keep_blocks that only this sequence (and the tree) holds, deepest first
        for i in range(seq.num_cached_blocks - 1, keep_blocks - 1, -1):
            block_id = seq.block_table[i]
            if rc[block_id] != 2 or tree.block_hash(block_id) != seq.block_hashes[i]:
                break
            own.append(block_id)
        seq.num_cached_blocks -= tree.uncache(own)
        del seq.block_hashes[seq.num_cached_blocks :]

    def check_invariants(self) -> None:
        """Recount everything from scratch: exact ref counts (tables + shadows + tree), each block exactly one of
        free / evictable / in use, per-sequence bounds, host pool ownership. O(blocks + sequences * table).

        Raises:
            AssertionError: with a message naming the sequence or block.
        """
        from radix.invariants import check_manager

        check_manager(self)
