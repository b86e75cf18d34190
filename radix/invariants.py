"""check_invariants() of KVCacheManager: recount every reference and block state from scratch (tests call it after
every operation; too slow for the serving loop: O(blocks + sequences * table length))."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radix.manager import KVCacheManager


def check_manager(m: KVCacheManager) -> None:
    """Raise AssertionError (naming the sequence or block) if any KVCacheManager invariant is broken:
    exact ref counts, free + evictable + in_use == total with each block counted once, live block tables only
    reference allocated blocks, the cached prefix of each sequence is resident, host blocks have one owner."""
    pool, tree, host = m._pool, m._tree, m._host_pool
    pool.check_invariants()
    tree.check_invariants()
    host.check_invariants()
    bs = m.block_size
    expected: Counter[int] = Counter()
    host_owner: Counter[int] = Counter()
    for seq_id, seq in m._seqs.items():
        assert seq.num_computed <= len(seq.token_ids), f"seq {seq_id}: computed {seq.num_computed} > known tokens"
        if seq.host_table is not None:
            assert not seq.block_table and not seq.shadow, f"seq {seq_id} swapped out but holds device blocks"
            host_owner.update(seq.host_table)
            continue
        assert seq.num_computed <= len(seq.block_table) * bs, f"seq {seq_id}: computed tokens exceed its table"
        assert len(set(seq.block_table)) == len(seq.block_table), f"seq {seq_id} lists a block twice"
        expected.update(seq.block_table)
        expected.update(seq.shadow)
        n = seq.num_cached_blocks
        assert n <= min(len(seq.block_table), seq.num_computed // bs), f"seq {seq_id}: {n} cached blocks too many"
        assert len(seq.block_hashes) == n, f"seq {seq_id}: {len(seq.block_hashes)} hashes for {n} cached blocks"
        for i in range(n):
            resident = tree.resident_block(seq.block_hashes[i])
            assert resident is not None, f"seq {seq_id}: cached block {i} is not resident"
            assert resident == seq.block_table[i] or resident in seq.shadow, (
                f"seq {seq_id}: block {i} resident as {resident} but neither in its table nor its shadow"
            )
    for h in tree.hashes():
        expected[tree.resident_block(h)] += 1
    for b in range(pool.first_block_id, pool.num_blocks):
        assert pool.ref_counts[b] == expected[b], f"block {b}: ref count {pool.ref_counts[b]}, holders {expected[b]}"
    assert 0 not in expected, "the null block 0 is referenced"
    free = set(pool.free_block_ids())
    evictable = {b for b in map(tree.resident_block, tree.hashes()) if pool.ref_counts[b] == 1}
    in_use = {b for b in range(pool.first_block_id, pool.num_blocks) if pool.ref_counts[b] >= 1} - evictable
    assert not (free & evictable or free & in_use), "a block is both free and held"
    assert len(free) + len(evictable) + len(in_use) == pool.num_usable, (
        f"free {len(free)} + evictable {len(evictable)} + in_use {len(in_use)} != total {pool.num_usable}"
    )
    assert len(evictable) == tree.num_evictable, f"evictable count {tree.num_evictable}, real {len(evictable)}"
    for b in range(host.num_blocks):
        assert host.ref_counts[b] == host_owner[b], f"host block {b}: ref {host.ref_counts[b]}, owners {host_owner[b]}"
