"""HybridKVCacheManager: a KVCacheManager with two KV cache groups, full attention (group 0: the manager's own pool,
tables and radix tree, unchanged) and sliding window (group 1: a SlidingWindowGroup, radix/swa_group.py).

A model whose layers are all full attention gets the plain KVCacheManager (one group, today's code path); one with
sliding-window layers may get this class, which keeps each sequence's window blocks in a second pool sized for what
its sliding layers still read (at most cdiv(W, B) + 1 blocks a sequence after each step), after vLLM's hybrid KV cache
manager (one block pool per KV cache group, a coordinator that finds the hit every group agrees on) and SGLang's SWA
radix cache (a node whose window block is evicted stays in the tree).

What each method adds to the base's, in both groups all or nothing:
- match_prefix: the base's match, cut to the longest prefix whose window (the blocks a query after it reads) is
  cached in group 1; add_sequence locks that window there and takes the new blocks in both groups.
- allocate: a new position needs one block in each group (the tables are aligned), so both count; can_allocate
  counts group 1 as the window a sequence keeps (cdiv(W, B) + 1 blocks at most), not the whole request.
  release_uncomputed (speculative decoding's rollback of rejected draft slots) cuts both tables to the same length.
- prepare_write: copy-on-write in each group; group 1's pairs wait in take_window_copies.
- commit_computed / free: group 0 caches full blocks in the tree; group 1 gives each newly cached node the sequence's
  window block, then releases the blocks the window has passed (they stay cached, evictable on their own).
- kv_snapshot: with group 1's hashes (its KV events: radix/events.py, group 1).
- fork: both tables. swap_out / swap_in: both groups, each into its own host swap pool (group 1's: as many blocks as
  group 0's, radix/swa_group.py); group 1's pairs wait in take_window_swaps.

Which window blocks stay cached: every full block's window block is attached to its tree node when the block is
cached and becomes evictable once the sequence's window moves past it, so a finished request leaves the window before
its end (its next turn hits the whole prompt + output) and every branch point keeps its window until eviction, least
recently released first; a hit re-locks the window it uses, so a shared system prompt's window stays recent while
conversations keep starting from it.

The host tier (num_host_cache_blocks) holds group 0's blocks only. When group 0 writes a cached block back to the
host, its node stays in the tree and keeps its window block in group 1, on the device, until group 1's own LRU
evicts it (then the node is marked, and a match is cut where a window it needs is missing, as without a tier); a
node that leaves the tree (a host-tier victim, or a write-back with no host block) drops it. So a match reaching
host-only nodes needs no load in group 1: add_sequence loads group 0's blocks back and locks the window, resident.
Why not write the window block back with its full block: the two groups' pressures are apart (group 0's evicting a
block says nothing about group 1's room), a hit at h reads only the window before h (cdiv(W, B) blocks, not one per
cached block), and a window block is the larger copy (Gemma 3: 5 of every 6 layers slide), so copying every one out
and back would spend host memory and PCIe traffic on blocks most hits never read.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from radix.block_pool import NoFreeBlocksError
from radix.blocks import cdiv
from radix.events import KvSnapshot
from radix.keys import BlockKeys
from radix.manager import KVCacheManager
from radix.node import Node
from radix.prefix_match import PrefixMatch, StaleMatchError
from radix.swa_group import SlidingWindowGroup
from radix.tree import RadixTree


class WindowGroupStats(NamedTuple):
    """Block counters of the sliding-window group (null block excluded): total = free + evictable + in_use; cached:
    blocks held by tree nodes (evictable or in use); evicted: cached blocks evicted since the start."""

    total_blocks: int
    free_blocks: int
    evictable_blocks: int
    in_use_blocks: int
    cached_blocks: int
    evicted_blocks: int


class WindowSwaps(NamedTuple):
    """Group 1's swap copies of a step: swap_out (device, host) pairs, then swap_in (host, device) pairs."""

    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]


class HybridKVCacheManager(KVCacheManager):
    """KVCacheManager (group 0, full attention) plus a sliding-window group of ``num_window_blocks`` blocks.

    Args:
        num_blocks, block_size, enable_prefix_caching, num_host_blocks, record_events, hash_fn,
            num_host_cache_blocks: as KVCacheManager (group 0; the host tier holds group 0's blocks only: module
            docstring; group 1 gets a swap pool of num_host_blocks blocks of its own).
        num_window_blocks: group 1's blocks including its null block 0, >= 2.
        window: the sliding layers' window W in tokens, >= 1.
    Raises:
        ValueError: bad sizes.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, *, num_window_blocks: int, window: int, **kwargs) -> None:
        super().__init__(num_blocks, block_size, **kwargs)
        self._window = SlidingWindowGroup(num_window_blocks, block_size, window, self.num_host_blocks, self._events)
        self._window_copies: list[tuple[int, int]] = []
        self._window_swaps = WindowSwaps([], [])
        if isinstance(self._cache, RadixTree):
            self._cache.watch_forget(self._window.forget)

    @property
    def window(self) -> int:
        """The sliding window W in tokens. O(1)."""
        return self._window.window

    # ----------------------------------------------------------------- admission and growth
    def match_prefix(self, keys: BlockKeys) -> PrefixMatch:
        """The base's match (both tiers) cut to the longest prefix whose window is cached in group 1 (radix/
        swa_group.py usable_prefix), with that window's blocks. Pure. O(matched blocks). Raises ValueError as the
        base."""
        found = super().match_prefix(keys)
        window = self._window
        matched = len(found.block_ids) + len(found.host_nodes)
        if not matched:
            return found._replace(window_epoch=window.epoch)
        nodes = _path(found.last_node, matched)
        h = window.usable_prefix(nodes)
        num_device = len(found.block_ids)
        return PrefixMatch(
            found.block_ids[:h],
            h * self.block_size,
            keys,
            nodes[h - 1] if h else None,
            found.epoch,
            found.host_nodes[: max(0, h - num_device)],
            window.window_blocks(nodes, h),
            window.epoch,
        )

    def is_current(self, match: PrefixMatch) -> bool:
        """Whether match's blocks are still where it says in both groups. O(1)."""
        return super().is_current(match) and match.window_epoch == self._window.epoch

    def add_sequence(
        self, seq_id: int, match: PrefixMatch, num_new_tokens: int | None = None, *, count_stats: bool = True
    ) -> int | None:
        """The base's add_sequence, and in group 1 the match's window locked and a block for each new position.
        Returns the cached tokens, or None with no side effect when either group lacks room. Raises as the base
        (StaleMatchError also when group 1 moved on since the match)."""
        window = self._window
        if match.window_epoch != window.epoch:
            raise StaleMatchError(f"window blocks matched at epoch {match.window_epoch}, now {window.epoch}")
        n_new = match.keys.num_tokens - match.num_tokens if num_new_tokens is None else num_new_tokens
        num_cached = match.num_tokens // self.block_size
        need = cdiv(match.num_tokens + max(0, n_new), self.block_size) - num_cached
        # the window of the prefix the match keeps (a caller may cut a match short, as a prompt_logprobs request does)
        keep = num_cached - window.first_live(match.num_tokens)
        blocks = match.window_blocks[len(match.window_blocks) - keep :] if keep > 0 else []
        if not window.fits(need, blocks):
            return None
        cached = super().add_sequence(seq_id, match, num_new_tokens, count_stats=count_stats)
        if cached is not None:
            window.add(seq_id, cached, blocks, need)
        return cached

    def allocate(self, seq_id: int, num_new_tokens: int) -> list[int] | None:
        """The base's allocate, and as many new blocks in group 1 (aligned tables). Returns group 0's new blocks
        (group 1's: window_block_table), or None with no side effect when either group lacks room."""
        seq = self._live(seq_id)
        need = cdiv(seq.num_computed + num_new_tokens, self.block_size) - len(seq.block_table)
        if need > 0 and not self._window.can_allocate(need):
            return None
        blocks = super().allocate(seq_id, num_new_tokens)
        if blocks:
            self._window.grow(seq_id, len(seq.block_table))
        return blocks

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether num_blocks new blocks can be had in group 0 now, and in group 1 as many as a sequence keeps live
        at once after a step (min(num_blocks, cdiv(W, B) + 1): the scheduler asks before admitting a whole prompt,
        whose window blocks are released chunk by chunk; add_sequence / allocate check each chunk's exact need).
        O(1)."""
        live = min(num_blocks, cdiv(self._window.window, self.block_size) + 1)
        return super().can_allocate(num_blocks) and self._window.can_allocate(live)

    def prepare_write(self, seq_id: int, start: int, end: int) -> list[tuple[int, int]]:
        """Copy-on-write in both groups, all or nothing; returns group 0's (src, dst) pairs, group 1's wait in
        take_window_copies. Raises as the base (NoFreeBlocksError, also when group 1 lacks room: nothing changed)."""
        self._live(seq_id)
        shared = self._window.shared_in(seq_id, start, end) if start < end else []
        if not self._window.can_allocate(len(shared)):
            raise NoFreeBlocksError(f"window group: copy-on-write needs {len(shared)} blocks, cannot free enough")
        pairs = super().prepare_write(seq_id, start, end)
        self._window_copies.extend(self._window.copy_on_write(seq_id, start, end))
        return pairs

    def take_window_copies(self) -> list[tuple[int, int]]:
        """Group 1's copy-on-write (src, dst) pairs since the last call, for the step's forward. O(1)."""
        pairs = self._window_copies
        self._window_copies = []
        return pairs

    def commit_computed(self, seq_id: int, num_tokens: int) -> None:
        """The base's commit, then group 1: window blocks of the newly cached full blocks go to their nodes, blocks
        before the window are released. Raises as the base."""
        seq = self._live(seq_id)
        before = seq.num_cached_blocks
        super().commit_computed(seq_id, num_tokens)
        self._cache_window(seq_id, before, seq.num_cached_blocks, seq.cached_node)
        self._window.release_before(seq_id, num_tokens)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The base's fork, and the child's copy of the parent's group 1 table. Raises as the base."""
        super().fork(parent_id, child_id)
        self._window.fork(parent_id, child_id)

    def free(self, seq_id: int, keep_tokens: int | None = None) -> None:
        """The base's free, then group 1: window blocks of the blocks it cached go to their nodes, and the
        sequence's references go. Raises as the base."""
        seq = self._get(seq_id)
        before = seq.num_cached_blocks
        super().free(seq_id, keep_tokens)
        self._cache_window(seq_id, before, seq.num_cached_blocks, seq.cached_node)
        self._window.free(seq_id)

    def swap_out(self, seq_id: int) -> list[tuple[int, int]] | None:
        """The base's swap_out, and group 1's live window blocks to its own host pool, all or nothing. Returns group
        0's (device, host) pairs (group 1's wait in take_window_swaps), or None with no side effect when either host
        pool lacks room. O(blocks * log n). Raises as the base."""
        self._live(seq_id)
        if not self._window.can_swap_out(seq_id):
            return None
        pairs = super().swap_out(seq_id)
        if pairs is not None:
            self._window_swaps.swap_out.extend(self._window.swap_out(seq_id))
        return pairs

    def swap_in(self, seq_id: int) -> list[tuple[int, int]] | None:
        """The base's swap_in, and group 1's window blocks back from its host pool, all or nothing. Returns group
        0's (host, device) pairs (group 1's wait in take_window_swaps), or None with no side effect when either group
        lacks device room. O(blocks * log n). Raises as the base."""
        if self._get(seq_id).host_table is None:
            raise ValueError(f"sequence {seq_id} is not swapped out")
        if not self._window.can_swap_in(seq_id):
            return None
        pairs = super().swap_in(seq_id)
        if pairs is not None:  # group 0's evictions only ever free window blocks: group 1 still fits
            self._window_swaps.swap_in.extend(self._window.swap_in(seq_id))
        return pairs

    def take_window_swaps(self) -> WindowSwaps:
        """Group 1's swap pairs since the last call, for the step's ForwardBatch (window_swap_out / window_swap_in:
        the worker copies them as it copies group 0's swaps). O(1)."""
        swaps = self._window_swaps
        self._window_swaps = WindowSwaps([], [])
        return swaps

    # ----------------------------------------------------------------- queries
    def window_block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's group 1 table (NULL_BLOCK before its window; empty while swapped out), as
        block_table. O(blocks). Raises UnknownSequenceError."""
        self._get(seq_id)
        return list(self._window.tables.get(seq_id, []))

    def kv_snapshot(self) -> KvSnapshot:
        """The base's snapshot, with the hashes of the nodes holding a window block (group 1), W and B. O(cached
        blocks)."""
        snapshot = super().kv_snapshot()
        hashes = [node.block_hash for node in self._window.node_block if node.block_hash is not None]
        return msgspec.structs.replace(
            snapshot, window_block_hashes=hashes, sliding_window=self._window.window, block_size=self.block_size
        )

    def window_stats(self) -> WindowGroupStats:
        """Group 1's block counters. O(1)."""
        window = self._window
        total = window.pool.num_usable
        free = window.pool.num_free
        evictable = window.num_evictable
        return WindowGroupStats(
            total, free, evictable, total - free - evictable, len(window.node_block), window.num_evicted
        )

    def check_invariants(self) -> None:
        """The base's invariants, then group 1's (radix/swa_group.py check_invariants). Raises AssertionError."""
        super().check_invariants()
        cache = self._cache
        computed = {seq_id: seq.num_computed for seq_id, seq in self._seqs.items()}
        if isinstance(cache, RadixTree):
            self._window.check_invariants(computed, cache.holds)
        else:
            self._window.check_invariants(computed, lambda node: False)

    # ----------------------------------------------------------------- speculative decoding
    def release_uncomputed(self, seq_id: int) -> list[int]:
        """Speculative decoding's rollback in both groups: the base's (group 0's entries past cdiv(num_computed, B)
        leave the table), then group 1's table is cut to the same length (aligned tables), each entry cut losing this
        sequence's reference (a cached one becomes evictable, any other goes free). Returns group 0's released
        blocks. O(released). Raises as the base."""
        released = super().release_uncomputed(seq_id)
        num_blocks = len(self._live(seq_id).block_table)
        table = self._window.tables[seq_id]
        cut = table[num_blocks:]
        del table[num_blocks:]
        self._window.unlock(cut)  # none is NULL: they lie past the computed tokens, so inside the window
        return released

    def _cache_window(self, seq_id: int, start: int, end: int, last: Node | None) -> None:
        if end > start:
            self._window.cache(seq_id, start, _path(last, end - start))


def _path(last: Node | None, n: int) -> list[Node]:
    """The n nodes ending at last, root first (last's ancestors). O(n)."""
    nodes = []
    node = last
    for _ in range(n):
        assert node is not None
        nodes.append(node)
        node = node.parent
    nodes.reverse()
    return nodes
