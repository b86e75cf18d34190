"""BlockSupply: where the KVCacheManager's blocks come from and go besides its sequences' tables (its base class,
radix/manager.py): device blocks handed out with eviction (_take_blocks, can_allocate), preemption by swapping into
the host swap pool (radix/swap.py), and the copies of the host tier (radix/host_tier.py) each step carries.

Host memory has two pools: the swap pool (num_host_blocks, sequences preempted by swapping) and the host tier
(num_host_cache_blocks, cached blocks written back on eviction), accounted apart, each with its own invariant. The
worker keeps them in one host KV tensor, the swap pool's blocks first: a tier block h is worker host block
num_host_blocks + h (take_tier_copies returns worker ids). The attributes declared here are set by
KVCacheManager.__init__.
"""

from __future__ import annotations

from radix.block_pool import BlockPool
from radix.host_tier import HostTier, TierCopies
from radix.sequence import SeqBlocks
from radix.swap import swap_in, swap_out
from radix.tree import RadixTree


class UnknownSequenceError(KeyError):
    """The seq_id is not registered with the KVCacheManager."""


class BlockSupply:
    """Device block supply, swapping and host-tier copies over KVCacheManager's state (see the module docstring)."""

    num_host_blocks: int
    _pool: BlockPool
    _host_pool: BlockPool
    _tier: HostTier | None
    _tree: RadixTree
    _seqs: dict[int, SeqBlocks]
    _evicted_blocks: int

    # ----------------------------------------------------------------- swapping
    def swap_out(self, seq_id: int) -> list[tuple[int, int]] | None:
        """Preempt by swapping (radix/swap.py): every table block gets a host block, device references go.

        Returns (device, host) pairs the worker copies before anything overwrites them (in the same step), or None
        with no side effect when the host pool lacks room. O(blocks * log n). Raises ValueError if already swapped.
        """
        return swap_out(self._live(seq_id), self._host_pool, self._tree)

    def swap_in(self, seq_id: int) -> list[tuple[int, int]] | None:
        """Bring a swapped sequence back (radix/swap.py): new device blocks (evicting as needed), host blocks
        released. Returns (host, device) pairs the worker copies before the step, or None with no side effect when
        the device lacks room. O(blocks * log n). Raises ValueError if the sequence is not swapped out.
        """
        seq = self._get(seq_id)
        if seq.host_table is None:
            raise ValueError(f"sequence {seq_id} is not swapped out")
        if not self.can_allocate(len(seq.host_table)):
            return None
        return swap_in(seq, self._host_pool, self._take_blocks(len(seq.host_table)))

    # ----------------------------------------------------------------- host tier copies
    def waits_for_loads(self, seq_id: int) -> bool:
        """Whether a block of the sequence's cached prefix is still being loaded back (its copy is in the step
        being planned or in flight): attention must not read it, so the sequence stays out of this step's forward.
        O(cached blocks). Raises UnknownSequenceError, ValueError (swapped out)."""
        seq = self._live(seq_id)
        if self._tier is None or not self._tier.loading:
            return False
        loading = self._tier.loading
        return any(b in loading for b in seq.block_table[: seq.num_cached_blocks])

    def take_tier_copies(self) -> TierCopies:
        """The write-back (device, host) and load-back (host, device) pairs scheduled since the last call, host ids
        as the worker's (after its num_host_blocks swap blocks), for this step's ForwardBatch swap_out / swap_in.
        Their blocks stay pinned until tier_copies_done. O(copies)."""
        return TierCopies([], []) if self._tier is None else self._tier.take_copies(self.num_host_blocks)

    def tier_copies_done(self) -> None:
        """The worker ran the step that carried the taken copies: release the loads' device references (a block
        nobody else holds becomes evictable, or free), unpin the host blocks, end the loads. O(pins * log n)."""
        tier = self._tier
        if tier is None:
            return
        if tier.device_pins:
            self._tree.unlock(tier.device_pins)
            tier.device_pins = []
        tier.copies_done()

    # ----------------------------------------------------------------- device blocks
    def can_allocate(self, num_blocks: int) -> bool:
        """Whether num_blocks new blocks can be handed out now (free + evictable >= num_blocks). O(1)."""
        return num_blocks <= self._pool.num_free + self._tree.num_evictable

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

    def _take_blocks(self, n: int) -> list[int]:
        """n blocks off the free queue (ref count 1 each), evicting LRU device leaves for the shortfall (check
        can_allocate first). O(n log N)."""
        short = n - self._pool.num_free
        if short > 0:
            self._evicted_blocks += len(self._tree.evict(short))
        return self._pool.allocate(n)
