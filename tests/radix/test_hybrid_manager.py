"""HybridKVCacheManager (radix/hybrid_manager.py): exact window tables, releases, hits cut to a resident window,
window blocks evicted on their own, the tree's removals dropping them, forks and copy-on-write in both groups."""

from __future__ import annotations

import pytest

from radix.block_pool import NULL_BLOCK
from radix.blocks import cdiv
from radix.hybrid_manager import HybridKVCacheManager, WindowGroupStats
from radix.prefix_match import StaleMatchError
from tests.radix.radix_testing import admit, match

B = 4
W = 8  # a query reads keys k > q - 8: two blocks back


def hybrid(num_blocks: int = 32, num_window_blocks: int = 16, **kwargs: object) -> HybridKVCacheManager:
    return HybridKVCacheManager(num_blocks, B, num_window_blocks=num_window_blocks, window=W, **kwargs)


def decode(m: HybridKVCacheManager, seq_id: int, token: int) -> None:
    """One decode step: allocate a slot for the last known token, write it, then learn the sampled one."""
    computed = m.num_computed_tokens(seq_id)
    assert m.allocate(seq_id, 1) is not None
    m.prepare_write(seq_id, computed, computed + 1)
    m.commit_computed(seq_id, computed + 1)
    m.append_tokens(seq_id, [token])
    m.check_invariants()


def test_window_blocks_released_as_the_sequence_advances() -> None:
    m = hybrid()
    prompt = list(range(1, 11))  # 10 tokens: blocks 0..2
    assert admit(m, 1, prompt) == 0
    assert m.window_block_table(1) == [1, 2, 3]
    m.commit_computed(1, 10)  # first_live(10) = (10 - 8) // 4 = 0: nothing released yet
    m.append_tokens(1, [50])
    assert m.window_block_table(1) == [1, 2, 3]
    for t in range(51, 57):
        decode(m, 1, t)
    # 16 computed: first_live = 2, so blocks 0 and 1 are released and stay cached: all four blocks are full, cached
    assert m.num_computed_tokens(1) == 16
    assert m.window_block_table(1) == [NULL_BLOCK, NULL_BLOCK, 3, 4]
    assert m.block_table(1) == [1, 2, 3, 4]
    assert m.window_stats() == WindowGroupStats(15, 11, 2, 2, 4, 0)
    live = [b for b in m.window_block_table(1) if b != NULL_BLOCK]
    assert len(live) <= cdiv(W, B) + 1


def test_turn_two_hits_turn_one_prompt_and_output() -> None:
    m = hybrid()
    prompt = list(range(1, 15))  # 14 tokens
    admit(m, 1, prompt)
    m.commit_computed(1, 14)
    m.append_tokens(1, [90])
    for t in range(91, 97):
        decode(m, 1, t)
    history = prompt + list(range(90, 97))  # 21 tokens, 20 computed
    m.free(1)
    m.check_invariants()
    # turn 2: the history plus a new message; its 5 full blocks are cached, the window before 20 (blocks 3, 4) too
    turn2 = history + [7, 7, 7]
    blocks, n = match(m, turn2)
    assert (blocks, n) == ([1, 2, 3, 4, 5], 20)
    assert admit(m, 2, turn2) == 20
    assert m.window_block_table(2) == [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 4, 5, 6]
    m.check_invariants()


def test_new_conversation_hits_the_shared_system_prompt() -> None:
    m = hybrid()
    system = list(range(100, 112))  # 12 tokens: three full blocks
    first = system + list(range(1, 20))
    admit(m, 1, first)
    m.commit_computed(1, len(first))  # the window moved far past the system prompt: its blocks were released
    assert m.window_block_table(1)[:3] == [NULL_BLOCK] * 3
    second = system + [9, 9, 9, 9, 9]
    assert match(m, second) == ([1, 2, 3], 12)  # their window blocks stayed cached on the nodes
    assert admit(m, 2, second) == 12
    assert m.window_block_table(2) == [NULL_BLOCK, 2, 3, 9, 10]
    m.check_invariants()


def test_hit_is_cut_where_the_window_was_evicted() -> None:
    m = hybrid()
    prompt = list(range(1, 22))  # 21 tokens: five full blocks
    admit(m, 1, prompt)
    m.commit_computed(1, 21)
    m.free(1)
    query = prompt + [5]
    taken = m.match_prefix(m.block_keys(query))
    assert taken.num_tokens == 20 and taken.window_blocks == [4, 5]
    assert m._window.evict(1) == [1]  # the least recently released window block: block 0's
    assert not m.is_current(taken)
    with pytest.raises(StaleMatchError):
        m.add_sequence(2, taken)
    assert match(m, query) == ([1, 2, 3, 4, 5], 20)  # block 0's window is not needed at 20
    m._window.evict(3)  # blocks 1, 2, 3's windows: the window before 20 (blocks 3, 4) is incomplete
    # h = 5 needs [3, 5), h = 4 needs [2, 4), h = 3 needs [1, 3), h = 2 needs [0, 2): all miss; h = 1 needs [0, 1)
    assert match(m, query) == ([], 0)
    m.check_invariants()


def test_tree_eviction_drops_the_nodes_window_blocks() -> None:
    m = hybrid(num_blocks=8)
    admit(m, 1, list(range(1, 13)))
    m.commit_computed(1, 12)
    m.free(1)
    assert m.window_stats().cached_blocks == 3
    admit(m, 2, list(range(50, 77)))  # 27 tokens: 7 blocks, every cached full block is evicted
    assert m.window_stats().cached_blocks == 0
    m.check_invariants()
    m.free(2)
    m.check_invariants()


def test_fork_and_copy_on_write_in_both_groups() -> None:
    m = hybrid()
    admit(m, 1, list(range(1, 7)))  # 6 tokens: the second block is partial
    m.commit_computed(1, 6)
    m.fork(1, 2)
    assert m.window_block_table(2) == [1, 2]
    assert m.allocate(2, 1) == []
    assert m.prepare_write(2, 6, 7) == [(2, 3)]
    assert m.take_window_copies() == [(2, 3)]
    assert m.window_block_table(2) == [1, 3]
    m.check_invariants()
    m.free(1)
    m.free(2)
    m.check_invariants()
    assert m.window_stats() == WindowGroupStats(15, 14, 1, 0, 1, 0)


def test_admission_fails_cleanly_when_the_window_group_is_full() -> None:
    m = hybrid(num_window_blocks=4)  # 3 usable window blocks
    assert admit(m, 1, list(range(1, 17))) is None  # 4 blocks in one chunk
    assert m.stats().num_sequences == 0
    assert admit(m, 1, list(range(1, 17)), num_new_tokens=8) == 0
    assert m.allocate(1, 16) is None  # two more window blocks: one is free
    m.commit_computed(1, 8)
    assert m.allocate(1, 8) is None  # first_live(8) = 0: nothing released, still two short of one
    assert m.block_table(1) == [1, 2] and m.window_block_table(1) == [1, 2]
    assert m.allocate(1, 4) == [3]
    m.commit_computed(1, 12)  # first_live(12) = 1: block 0's window block is released, cached, evictable
    assert m.window_stats() == WindowGroupStats(3, 0, 1, 2, 3, 0)
    assert m.allocate(1, 4) == [4]  # takes it: evicted from its node, which stays in the tree
    assert m.window_block_table(1) == [NULL_BLOCK, 2, 3, 1]
    assert m.window_stats() == WindowGroupStats(3, 0, 0, 3, 2, 1)
    m.check_invariants()
    assert m.swap_out(1) is None
    m.free(1)
    m.check_invariants()


def test_a_match_cut_to_nothing_takes_no_window_blocks() -> None:
    m = hybrid()
    prompt = list(range(1, 22))
    admit(m, 1, prompt)
    m.commit_computed(1, 21)
    m.free(1)
    taken = m.match_prefix(m.block_keys(prompt + [5]))
    assert taken.num_tokens == 20 and taken.window_blocks == [4, 5]
    # what the scheduler does for a prompt_logprobs request: no cached prefix
    cut = taken._replace(block_ids=[], num_tokens=0, last_node=None, host_nodes=[])
    assert m.add_sequence(2, cut, 4) == 0
    assert m.window_block_table(2) == [7]  # the free queue: 7 .. 15, then 6 (the partial block freed last)
    m.check_invariants()
