"""BlockSupply: where the KVCacheManager's blocks come from and go besides its sequences' tables (a part the manager
owns, radix/manager.py): device blocks handed out with eviction from the prefix cache, preemption by swapping into the
host swap pool (radix/swap.py), and the copies of the host tier (radix/host_tier.py) each step carries.

Host memory has two pools: the swap pool (num_host_blocks, sequences preempted by swapping) and the host tier
(num_host_cache_blocks, cached blocks written back on eviction), accounted apart, each with its own invariant. The
worker keeps them in one host KV tensor, the swap pool's blocks first: a tier block h is worker host block
num_host_blocks + h (take_tier_copies returns worker ids).
"""

from __future__ import annotations

from collections.abc import Sequence

from radix.block_pool import BlockPool, NoFreeBlocksError
from radix.host_tier import HostTier, TierCopies
from radix.prefix_cache import PrefixCache
from radix.sequence import SeqBlocks
from radix.swap import release_host, swap_in, swap_out


class BlockSupply:
    """Device block supply, swapping and host-tier copies (see the module docstring).

    Args:
        pool: the device BlockPool.
        cache: the prefix cache whose evictable blocks make room, and which holds the references of block tables.
        host_pool: the swap pool (ids 0 .. host_pool.num_blocks - 1).
        tier: the prefix cache's host tier (None: no tier, no tier copies).
    Mutates the pools, the prefix cache, the tier and the SeqBlocks it is given.
    """

    def __init__(self, pool: BlockPool, cache: PrefixCache, host_pool: BlockPool, tier: HostTier | None) -> None:
        self.pool = pool
        self.cache = cache
        self.host_pool = host_pool
        self.tier = tier
        self.num_evicted = 0  # cached device blocks evicted by take since the start

    # ----------------------------------------------------------------- device blocks
    def can_allocate(self, num_blocks: int) -> bool:
        """Whether num_blocks new blocks can be handed out now (free + evictable >= num_blocks). O(1)."""
        return num_blocks <= self.pool.num_free + self.cache.num_evictable

    def fits(self, need: int, locked: Sequence[int]) -> bool:
        """Whether need new blocks can be had once the blocks ``locked`` are locked (a match about to be locked: those
        of them that are idle now cannot be evicted to make room). O(1), or O(len(locked)) when eviction is needed."""
        free = self.pool.num_free
        if need <= free:
            return True
        rcs = self.pool.ref_counts
        idle_locked = sum(rcs[b] == 1 for b in locked)
        return need <= free + self.cache.num_evictable - idle_locked

    def take(self, n: int) -> list[int]:
        """n blocks off the free queue (ref count 1 each), evicting LRU device leaves for the shortfall (check
        can_allocate first). O(n log N)."""
        short = n - self.pool.num_free
        if short > 0:
            self.num_evicted += len(self.cache.evict(short))
        return self.pool.allocate(n)

    def copy_on_write(self, table: list[int], indices: list[int]) -> list[tuple[int, int]]:
        """Replace table[i] for each i in indices by a new block (taken, evicting as needed); each old block loses
        this table's reference. Returns the (src, dst) pairs the worker copies before the step. O(len(indices) *
        log n).

        Raises NoFreeBlocksError: not enough blocks even after eviction (nothing changed)."""
        if not indices:
            return []
        if not self.can_allocate(len(indices)):
            raise NoFreeBlocksError(f"copy-on-write needs {len(indices)} blocks, cannot free enough")
        pairs = []
        for i, dst in zip(indices, self.take(len(indices)), strict=True):
            pairs.append((table[i], dst))
            table[i] = dst
        self.cache.unlock([src for src, _ in pairs])
        return pairs

    # ----------------------------------------------------------------- swapping
    def release_tail(self, table: list[int], keep: int) -> list[int]:
        """Cut table to its first keep entries and drop one reference from each entry cut (a private block returns to
        the free queue). Returns the cut block ids. O(cut * log n)."""
        released = table[keep:]
        del table[keep:]
        self.cache.unlock(released)
        return released

    def swap_out(self, seq: SeqBlocks) -> list[tuple[int, int]] | None:
        """Give every block of seq's (live) table a host block and release its device references (radix/swap.py).
        Returns (device, host) pairs, or None with no side effect when the swap pool lacks room. O(blocks * log n)."""
        return swap_out(seq, self.host_pool, self.cache)

    def swap_in(self, seq: SeqBlocks) -> list[tuple[int, int]] | None:
        """New device blocks (evicting as needed) for seq, swapped out (the caller checks), its host blocks released
        (radix/swap.py). Returns (host, device) pairs, or None with no side effect when the device lacks room.
        O(blocks * log n)."""
        assert seq.host_table is not None, "swap_in of a sequence that is not swapped out"
        if not self.can_allocate(len(seq.host_table)):
            return None
        return swap_in(seq, self.host_pool, self.take(len(seq.host_table)))

    def release_swapped(self, seq: SeqBlocks) -> None:
        """Return a swapped-out seq's host blocks to the swap pool (seq.host_table becomes None). O(blocks)."""
        release_host(seq, self.host_pool)

    # ----------------------------------------------------------------- host tier copies
    @property
    def device_pins(self) -> list[int]:
        """The device references held for pending loads (one per block of each load's path; [] without a tier).
        O(1): the tier's own list, not a copy."""
        return [] if self.tier is None else self.tier.device_pins

    def hold_loads(self, path: list[int]) -> None:
        """Hold one device reference on each block of a load's path (the matched device prefix and the blocks being
        loaded) until tier_copies_done, so none is freed, evicted or written back before its copy lands.
        O(len(path) * log n). Raises ValueError: a block is free; AssertionError without a tier."""
        assert self.tier is not None, "a load without a host tier"
        self.cache.lock(path)
        self.tier.device_pins.extend(path)

    def waits_for_loads(self, seq: SeqBlocks) -> bool:
        """Whether a block of seq's cached prefix is still being loaded back (its copy is in the step being planned
        or in flight). O(cached blocks)."""
        if self.tier is None or not self.tier.loading:
            return False
        loading = self.tier.loading
        return any(b in loading for b in seq.block_table[: seq.num_cached_blocks])

    def take_tier_copies(self) -> TierCopies:
        """The write-back and load-back pairs scheduled since the last call, host ids as the worker's (after its
        host_pool.num_blocks swap blocks). Their blocks stay pinned until tier_copies_done. O(copies)."""
        if self.tier is None:
            return TierCopies([], [])
        return self.tier.take_copies(self.host_pool.num_blocks)

    def tier_copies_done(self) -> None:
        """The worker ran the step that carried the taken copies: release the loads' device references, unpin the
        host blocks, end the loads. O(pins * log n)."""
        tier = self.tier
        if tier is None:
            return
        if tier.device_pins:
            self.cache.unlock(tier.device_pins)
            tier.device_pins = []
        tier.copies_done()
