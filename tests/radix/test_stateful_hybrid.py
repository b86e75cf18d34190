"""Hypothesis stateful tests of the HybridKVCacheManager (radix/hybrid_manager.py), a second KV cache group beside the
full-attention one:

- HybridAmpleMachine: the whole KVCacheMachine (tests/radix/test_stateful.py) against its reference model, on a
  hybrid manager whose window group never runs short: group 0 must behave exactly as the single-group manager (block
  ids, ref counts, free queues, LRU orders, tier copies), so every matched prefix has its window resident and is
  never cut, and group 1's invariants hold after every rule. Swapping is refused (group 1 has no host pool).
- HybridPressureMachine: a window group a few blocks large, so admission, growth and copy-on-write fail and window
  blocks are evicted on their own; after every rule both groups' invariants, a match never longer than group 0's,
  and at most cdiv(W, B) + 1 live window blocks per sequence beyond the ones allocated for uncomputed tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radix.block_pool import NULL_BLOCK, NoFreeBlocksError
from radix.blocks import cdiv
from radix.hybrid_manager import HybridKVCacheManager
from radix.manager import KVCacheManager
from tests.radix.radix_model import B, Model
from tests.radix.radix_testing import admit
from tests.radix.test_stateful import KVCacheMachine

pytestmark = pytest.mark.slow  # seconds per test: make test-fast leaves it out

TOKENS = st.lists(st.integers(1, 3), min_size=1, max_size=12)
WINDOWS = st.sampled_from([1, 2, 3, 4, 5])


class HybridAmpleMachine(KVCacheMachine):
    @initialize(
        num_blocks=st.integers(2, 16),
        num_tier=st.sampled_from([0, 1, 2, 3, 6]),
        window=WINDOWS,
    )
    def setup(self, num_blocks: int, num_tier: int, window: int) -> None:  # type: ignore[override]
        # group 1 holds at most one block per live table entry plus one per tree node: never short
        ample = 2 * num_blocks + num_tier + 2
        self.m = HybridKVCacheManager(
            num_blocks, B, num_window_blocks=ample, window=window, num_host_cache_blocks=num_tier
        )
        self.model = Model(num_blocks, 0, num_tier)
        self.next_id = 0
        self.seen: list[tuple[list[int], str | None]] = []

    @rule(index=st.integers(0, 50))
    def swap_out(self, index: int) -> None:
        seq_id = self.pick(index)
        if seq_id is not None:
            assert self.m.swap_out(seq_id) is None

    @rule()
    def swap_in(self) -> None:
        assert self.pick(0, swapped=True) is None

    @invariant()
    def window_never_short(self) -> None:
        assert isinstance(self.m, HybridKVCacheManager)
        assert self.m.window_stats().evicted_blocks == 0
        self.m.take_window_copies()


class HybridPressureMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 16), num_window=st.integers(2, 8), window=WINDOWS)
    def setup(self, num_blocks: int, num_window: int, window: int) -> None:
        self.m = HybridKVCacheManager(num_blocks, B, num_window_blocks=num_window, window=window)
        self.next_id = 0
        self.tokens: dict[int, list[int]] = {}
        self.seen: list[list[int]] = []

    def pick(self, index: int) -> int | None:
        ids = sorted(self.tokens)
        return ids[index % len(ids)] if ids else None

    @rule(tokens=TOKENS, chunk=st.sampled_from([None, 1, 2, 5]), again=st.integers(0, 50))
    def add(self, tokens: list[int], chunk: int | None, again: int) -> None:
        if self.seen and again % 3 == 0:
            tokens = self.seen[again % len(self.seen)] + tokens[:2]  # a later turn
        cached = admit(self.m, self.next_id, tokens, None, chunk)
        if cached is None:
            return
        assert cached % B == 0 and cached < len(tokens)
        self.tokens[self.next_id] = list(tokens)
        self.seen.append(list(tokens))
        self.next_id += 1

    @rule(index=st.integers(0, 50), chunk=st.integers(1, 5), token=st.integers(1, 3))
    def step(self, index: int, chunk: int, token: int) -> None:
        seq_id = self.pick(index)
        if seq_id is None:
            return
        m = self.m
        tokens = self.tokens[seq_id]
        computed = m.num_computed_tokens(seq_id)
        allocated = len(m.block_table(seq_id)) * B
        if computed == len(tokens):
            m.append_tokens(seq_id, [token])
            tokens.append(token)
        n = min(chunk, len(tokens) - computed)
        if m.allocate(seq_id, n) is None:
            assert not m.can_allocate(cdiv(computed + n, B) - allocated // B)
            return
        try:
            m.prepare_write(seq_id, computed, computed + n)
        except NoFreeBlocksError:
            m.take_window_copies()
            return
        m.take_window_copies()
        m.commit_computed(seq_id, computed + n)

    @rule(index=st.integers(0, 50))
    def fork(self, index: int) -> None:
        parent = self.pick(index)
        if parent is not None:
            self.m.fork(parent, self.next_id)
            self.tokens[self.next_id] = list(self.tokens[parent])
            self.next_id += 1

    @rule(index=st.integers(0, 50), keep=st.one_of(st.none(), st.integers(0, 12)))
    def free(self, index: int, keep: int | None) -> None:
        seq_id = self.pick(index)
        if seq_id is not None:
            del self.tokens[seq_id]
            self.m.free(seq_id, keep)

    @rule(n=st.integers(1, 4), window=st.booleans())
    def evict(self, n: int, window: bool) -> None:
        if window:
            self.m._window.evict(n)
        else:
            self.m.tree.evict(n)

    @rule(index=st.integers(0, 50))
    def evict_window_block(self, index: int) -> None:
        """Evict one chosen idle window block (any position in a cached path, not only the LRU's first)."""
        group = self.m._window
        idle = list(group.lru)
        if not idle:
            return
        victim = idle[index % len(idle)]
        others = [b for b in idle if b != victim]
        group.lock(others)  # re-released: to the back of the LRU, behind the victim
        group.unlock(others)
        assert group.evict(1) == [victim]

    @rule(tokens=TOKENS, index=st.integers(0, 50))
    def match(self, tokens: list[int], index: int) -> None:
        if self.seen:
            tokens = self.seen[index % len(self.seen)] + tokens
        keys = self.m.block_keys(tokens)
        found = self.m.match_prefix(keys)
        full = KVCacheManager.match_prefix(self.m, keys)
        group = self.m._window
        nodes = []  # the full match's path, root first
        node = full.last_node
        for _ in range(len(full.block_ids) + len(full.host_nodes)):
            assert node is not None
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        usable = [
            h for h in range(len(nodes) + 1) if all(n in group.node_block for n in nodes[group.first_live(h * B) : h])
        ]
        assert found.num_tokens == max(usable) * B  # brute force: the longest prefix whose window is resident
        assert found.block_ids == full.block_ids[: len(found.block_ids)]
        lo = group.first_live(found.num_tokens)
        assert found.window_blocks == [group.node_block[n] for n in nodes[lo : found.num_tokens // B]]

    @invariant()
    def accounted(self) -> None:
        m = self.m
        m.check_invariants()
        bound = cdiv(m.window, B) + 1
        for seq_id in self.tokens:
            table = m.window_block_table(seq_id)
            live = sum(b != NULL_BLOCK for b in table)
            uncomputed = len(table) - cdiv(m.num_computed_tokens(seq_id), B)
            assert live <= bound + uncomputed, f"seq {seq_id}: {live} live window blocks"

    def teardown(self) -> None:
        for seq_id in list(self.tokens):
            self.m.free(seq_id)
        self.m.check_invariants()
        stats = self.m.window_stats()
        assert stats.in_use_blocks == 0 and stats.evictable_blocks == stats.cached_blocks
        assert self.m.stats().in_use_blocks == 0


HybridAmpleMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
HybridPressureMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_hybrid_group_zero_against_model = HybridAmpleMachine.TestCase
test_hybrid_under_window_pressure = HybridPressureMachine.TestCase
