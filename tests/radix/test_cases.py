"""Cases C1, C2, C4, C6, C9, C11, C12 of shared/cases/prefix-cache-cases.md at the radix level (bs=4)."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc

import pytest

from radix.hashing import hash_block_tokens
from radix.manager import KVCacheManager
from tests.radix.radix_testing import admit, is_cached, match, num_tokens, ref_count, slot_mapping, toks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_to_end(m: KVCacheManager, seq_id: int, tokens: list[int], salt: str | None = None) -> int:
    """Admit, compute the whole prompt, free. Returns the cached token count at admission."""
    cached = admit(m, seq_id, tokens, cache_salt=salt)
    assert cached is not None
    m.check_invariants()
    m.commit_computed(seq_id, len(tokens))
    m.check_invariants()
    m.free(seq_id)
    m.check_invariants()
    return cached


def test_c1_whole_prompt_cached_still_computes_the_last_token():
    m = KVCacheManager(11, block_size=4)
    assert run_to_end(m, 1, toks(1, 8)) == 0
    assert admit(m, 2, toks(1, 8)) == 4
    assert m.num_computed_tokens(2) == 4  # the last block (4 tokens, the last prompt token among them) is computed
    m.commit_computed(2, 8)
    m.free(2)
    assert admit(m, 3, toks(1, 12)) == 8  # the hash chain is intact
    m.free(3)
    assert admit(m, 4, toks(1, 9)) == 8
    assert num_tokens(m, 4) - m.num_computed_tokens(4) == 1
    m.free(4)
    assert admit(m, 5, toks(1, 3)) == 0
    m.check_invariants()


def test_c2_duplicate_blocks_after_recompute():
    m = KVCacheManager(11, block_size=4)
    start_free = m.num_free_blocks()
    assert run_to_end(m, 1, toks(1, 8)) == 0  # blocks 1, 2 cached
    assert admit(m, 2, toks(1, 8)) == 4
    b_table = m.block_table(2)
    assert b_table == [1, 3]  # block 3 recomputes [5..8], a duplicate of block 2
    m.commit_computed(2, 8)
    # the resident copy (2) was idle: the tree keeps B's block 3 in its place and frees 2, so B holds 2 blocks, not 3
    assert (ref_count(m, 1), ref_count(m, 2), ref_count(m, 3)) == (2, 0, 2)
    assert m.stats().cached_blocks == 2 and match(m, toks(1, 9)) == ([1, 3], 8)
    # everything else is handed out: none of B's blocks may be given to another request
    assert admit(m, 3, toks(100, 131)) == 0  # 8 blocks, the freed block 2 among them
    assert admit(m, 4, toks(200, 200)) is None  # 8 taken, 2 held by B
    assert 2 in m.block_table(3) and not set(m.block_table(3)) & set(b_table)
    for b in b_table:
        assert ref_count(m, b) >= 1 and b not in m._pool.free_block_ids()
    m.check_invariants()
    m.free(3)
    m.free(2)  # block 3 stays cached (evictable) under block 1
    assert ref_count(m, 3) == 1 and m.num_evictable_blocks() == 2
    assert m.num_free_blocks() + m.num_evictable_blocks() == start_free
    assert m.tree.clear()
    assert m.num_free_blocks() == start_free
    m.check_invariants()


def test_c4_eviction_bookkeeping():
    m = KVCacheManager(5, block_size=4)  # 4 usable blocks
    assert run_to_end(m, 1, toks(1, 8)) == 0  # A: blocks 1, 2 cached
    assert admit(m, 2, toks(101, 116)) == 0  # B: 16 new tokens evict both
    assert m.block_table(2) == [3, 4, 2, 1]
    assert m.stats().cached_blocks == 0
    m.commit_computed(2, 16)
    m.free(2)  # B's chain 3 <- 4 <- 2 <- 1 cached
    assert run_to_end(m, 3, toks(1, 8)) == 0  # C: no stale hit; evicts B's two deepest blocks
    assert match(m, toks(1, 9)) == ([1, 2], 8)
    assert admit(m, 4, toks(1, 13)) == 8  # D
    assert m.block_table(4) == [1, 2, 4, 3]
    assert [ref_count(m, b) for b in (1, 2)] == [2, 2]
    assert admit(m, 5, toks(300, 315)) is None  # E needs every block: waits, nothing evicted
    assert m.block_table(4) == [1, 2, 4, 3] and [ref_count(m, b) for b in (1, 2)] == [2, 2]
    m.commit_computed(4, 13)
    m.free(4)  # run 1 <- 2 <- 4 ([9..12]) cached, block 3 (token 13) freed
    assert m.tree.lru_order() == [4]
    before = [ref_count(m, b) for b in range(1, 5)]
    assert before == [1, 1, 0, 1]
    assert admit(m, 6, toks(1, 5)) == 4  # F: prefix of the longer run
    assert ref_count(m, 1) == 2
    m.commit_computed(6, 5)
    m.free(6)
    assert [ref_count(m, b) for b in range(1, 5)] == before
    assert m.tree.lru_order() == [4] and m.num_evictable_blocks() == 3
    # a parent is never evicted while a child is cached
    assert admit(m, 7, toks(500, 503) + [9]) == 0  # 2 blocks: free 3, then evict 4
    assert m.block_table(7) == [3, 4]
    assert is_cached(m.tree, 1) and is_cached(m.tree, 2) and not is_cached(m.tree, 4)
    m.check_invariants()


def test_c6_new_prompt_is_a_strict_prefix_of_a_cached_sequence():
    m = KVCacheManager(11, block_size=4)
    a = toks(1, 24)
    assert admit(m, 1, a[:16]) == 0
    m.commit_computed(1, 16)
    for t in a[16:]:  # decode 8 tokens
        m.append_tokens(1, [t])
        assert m.allocate(1, 1) is not None
        m.commit_computed(1, num_tokens(m, 1))
    a_table = m.block_table(1)
    m.free(1)
    assert m.stats().cached_blocks == 6
    assert admit(m, 2, a[:10]) == 8
    assert m.num_computed_tokens(2) == 8 and num_tokens(m, 2) == 10
    b_table = m.block_table(2)
    assert b_table[:2] == a_table[:2] and len(b_table) == 3
    assert b_table[2] not in a_table  # writing positions 8, 9 never touches A's cached block
    assert slot_mapping(m, 2, 8, 10) == [b_table[2] * 4, b_table[2] * 4 + 1]
    m.commit_computed(2, 10)
    m.free(2)
    assert match(m, a + [99]) == (a_table, 24)  # A's cached run is intact
    m.check_invariants()


def test_c9_accounting_invariant_with_shared_blocks_and_splits():
    m = KVCacheManager(11, block_size=4)
    total = m.stats().total_blocks
    for seq_id, tokens in enumerate([toks(1, 12), toks(1, 8) + toks(20, 23), toks(1, 4) + toks(30, 33)]):
        run_to_end(m, seq_id, tokens)
        s = m.stats()
        assert s.free_blocks + s.evictable_blocks + s.in_use_blocks == total
    assert m.stats().cached_blocks == 5  # 1 <- 2 <- {3, [20..23]}, 1 <- [30..33]
    assert m.tree.evict(total) and m.num_free_blocks() == total
    assert match(m, toks(1, 3)) == ([], 0)
    run_to_end(m, 9, toks(1, 3))
    assert m.stats().cached_blocks == 0 and m.num_free_blocks() == total
    m.check_invariants()


@pytest.mark.slow
def test_c9_insert_evict_cycles_leave_memory_where_it_started():
    m = KVCacheManager(11, block_size=4)

    def cycle(i: int) -> None:
        tokens = [i % 7 + 1, i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6, 1]
        admit(m, 0, tokens)
        m.commit_computed(0, 9)
        m.free(0)
        m.tree.evict(10)
        m.drain_events()

    for i in range(200):  # warm up caches (struct formats, free lists)
        cycle(i)
    tracemalloc.start()
    start, _ = tracemalloc.get_traced_memory()
    for i in range(10_000):
        cycle(i)
    end, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert m.num_free_blocks() == 10 and m.stats().cached_blocks == 0
    nodes = m.tree._nodes
    assert nodes.by_hash == {} and len(nodes.lru) == 0 and list(nodes.roots) == [None]
    assert end - start < 4096, f"memory grew by {end - start} bytes over 10k cycles"
    m.check_invariants()


def test_c11_weak_hash_collision_is_detected():
    m = KVCacheManager(11, block_size=4, hash_fn=lambda data: b"\x00" * 16)  # every block collides
    assert run_to_end(m, 1, toks(1, 4) + [99]) == 0
    assert m.stats().cached_blocks == 1
    assert admit(m, 2, toks(9, 12) + [99]) == 0  # same hash, different tokens: a miss
    assert m.block_table(2)[0] != 1  # not the colliding cached block
    m.commit_computed(2, 5)
    m.free(2)  # its block collides: not cached, freed
    assert m.stats().cached_blocks == 1
    assert admit(m, 3, toks(1, 4) + [7]) == 4  # the genuine content still hits
    m.check_invariants()


def test_c11_hash_is_process_independent():
    code = "from radix.hashing import hash_block_tokens; print(hash_block_tokens([1, 2, 3, 4], 4)[0].hex())"
    outs = []
    for seed in ("1", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout.strip())
    assert outs[0] == outs[1] == hash_block_tokens([1, 2, 3, 4], 4)[0].hex()


def test_c12_tenant_isolation():
    m = KVCacheManager(21, block_size=4)
    prompt = toks(1, 12)
    assert run_to_end(m, 1, prompt, salt="s1") == 0  # A
    assert run_to_end(m, 2, prompt, salt="s2") == 0  # B: different salt -> miss
    assert run_to_end(m, 3, prompt, salt="s1") == 8  # C: same salt -> hit
    assert run_to_end(m, 4, prompt) == 0  # D: no salt -> miss
    assert run_to_end(m, 5, prompt) == 8  # ... and no salt hits no salt
    assert match(m, prompt, cache_salt="s2") == (match(m, prompt, "s2")[0], 8)
    assert set(match(m, prompt, "s1")[0]).isdisjoint(match(m, prompt, "s2")[0])
