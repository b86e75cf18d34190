"""Hypothesis stateful tests of the HybridKVCacheManager (radix/hybrid_manager.py), a second KV cache group beside the
full-attention one:

- HybridAmpleMachine: the whole KVCacheMachine (tests/radix/test_stateful.py) against its reference model, swap pool
  and host tier included, on a hybrid manager whose window group never runs short: group 0 must behave exactly as
  the single-group manager (block ids, ref counts, free queues, LRU orders, swap and tier copies), so every matched
  prefix has its window resident and is never cut; group 1's invariants (per-group ref counts, its host swap pool)
  and the live-window bound hold after every rule, and each swap moves exactly the sequence's live window blocks.
- HybridPressureMachine: a window group a few blocks large, with a swap pool and a host tier, so admission, growth,
  copy-on-write and swap-in fail and window blocks are evicted on their own; after every rule both groups'
  invariants, a match never longer than group 0's (brute-forced), at most cdiv(W, B) + 1 live window blocks per
  sequence beyond the ones allocated for uncomputed tokens, and a refused swap changes nothing; a router's index fed
  the manager's KV events (both groups, both tiers) cuts every match exactly as the manager does; nothing leaked once
  every sequence is freed.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radix.block_pool import NULL_BLOCK, NoFreeBlocksError
from radix.blocks import cdiv
from radix.hashing import hash_block_tokens
from radix.hybrid_manager import HybridKVCacheManager
from radix.manager import KVCacheManager
from router.index import ReplicaIndex
from tests.radix.radix_model import B, Model
from tests.radix.radix_testing import admit
from tests.radix.test_stateful import KVCacheMachine

pytestmark = pytest.mark.slow  # seconds per test: make test-fast leaves it out

TOKENS = st.lists(st.integers(1, 3), min_size=1, max_size=12)
WINDOWS = st.sampled_from([1, 2, 3, 4, 5])


def live_window_bounded(m: HybridKVCacheManager, seq_ids: list[int]) -> None:
    """At most cdiv(W, B) + 1 live window blocks per live sequence, beyond those allocated for uncomputed tokens."""
    bound = cdiv(m.window, B) + 1
    for seq_id in seq_ids:
        table = m.window_block_table(seq_id)
        live = sum(b != NULL_BLOCK for b in table)
        uncomputed = len(table) - cdiv(m.num_computed_tokens(seq_id), B)
        assert live <= bound + uncomputed, f"seq {seq_id}: {live} live window blocks"


class HybridAmpleMachine(KVCacheMachine):
    @initialize(
        num_blocks=st.integers(2, 16),
        num_host=st.integers(0, 12),
        num_tier=st.sampled_from([0, 1, 2, 3, 6]),
        window=WINDOWS,
    )
    def setup(self, num_blocks: int, num_host: int, num_tier: int, window: int) -> None:  # type: ignore[override]
        # group 1 holds a block per live table entry (group 0's blocks, shared or not) plus one per tree node
        ample = 4 * num_blocks + num_tier + 4
        self.m = HybridKVCacheManager(
            num_blocks,
            B,
            num_window_blocks=ample,
            window=window,
            num_host_blocks=num_host,
            num_host_cache_blocks=num_tier,
        )
        self.model = Model(num_blocks, num_host, num_tier)
        self.next_id = 0
        self.seen: list[tuple[list[int], str | None]] = []

    @rule(index=st.integers(0, 50))
    def swap_out(self, index: int) -> None:
        m = self.m
        assert isinstance(m, HybridKVCacheManager)
        seq_id = self.pick(index)
        live = [] if seq_id is None else [b for b in m.window_block_table(seq_id) if b != NULL_BLOCK]
        super().swap_out(index)
        swaps = m.take_window_swaps()
        if seq_id is not None and self.model.seqs[seq_id].host is not None:
            assert [d for d, _ in swaps.swap_out] == live and swaps.swap_in == []
        else:
            assert swaps == ([], [])

    @rule(index=st.integers(0, 50))
    def swap_in(self, index: int) -> None:
        m = self.m
        assert isinstance(m, HybridKVCacheManager)
        seq_id = self.pick(index, swapped=True)
        super().swap_in(index)
        swaps = m.take_window_swaps()
        if seq_id is not None and self.model.seqs[seq_id].host is None:
            live = [b for b in m.window_block_table(seq_id) if b != NULL_BLOCK]
            assert swaps.swap_out == [] and [d for _, d in swaps.swap_in] == live
        else:
            assert swaps == ([], [])

    @invariant()
    def window_never_short(self) -> None:
        m = self.m
        assert isinstance(m, HybridKVCacheManager)
        assert m.window_stats().evicted_blocks == 0
        m.take_window_copies()
        live_window_bounded(m, [i for i, s in self.model.seqs.items() if s.host is None])


class HybridPressureMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 16),
        num_window=st.integers(2, 8),
        window=WINDOWS,
        num_host=st.integers(0, 6),
        num_tier=st.sampled_from([0, 2, 5]),
    )
    def setup(self, num_blocks: int, num_window: int, window: int, num_host: int, num_tier: int) -> None:
        self.m = HybridKVCacheManager(
            num_blocks,
            B,
            num_window_blocks=num_window,
            window=window,
            num_host_blocks=num_host,
            num_host_cache_blocks=num_tier,
            record_events=True,
        )
        self.index = ReplicaIndex()  # a router's view of this replica, from its KV events
        assert self.index.load_snapshot(self.m.kv_snapshot())
        self.next_id = 0
        self.tokens: dict[int, list[int]] = {}
        self.swapped: set[int] = set()
        self.seen: list[list[int]] = []

    def pick(self, index: int, swapped: bool | None = False) -> int | None:
        ids = sorted(i for i in self.tokens if swapped is None or (i in self.swapped) == swapped)
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
        seq_id = self.pick(index, swapped=None)
        if seq_id is not None:
            del self.tokens[seq_id]
            self.swapped.discard(seq_id)
            self.m.free(seq_id, keep)

    @rule(index=st.integers(0, 50))
    def swap_out(self, index: int) -> None:
        seq_id = self.pick(index)
        if seq_id is None:
            return
        m = self.m
        tables = (m.block_table(seq_id), m.window_block_table(seq_id))
        live = [b for b in tables[1] if b != NULL_BLOCK]
        pairs = m.swap_out(seq_id)
        swaps = m.take_window_swaps()
        if pairs is None:  # all or nothing
            assert (m.block_table(seq_id), m.window_block_table(seq_id)) == tables and swaps == ([], [])
            return
        assert [d for d, _ in pairs] == tables[0] and [d for d, _ in swaps.swap_out] == live
        self.swapped.add(seq_id)

    @rule(index=st.integers(0, 50))
    def swap_in(self, index: int) -> None:
        seq_id = self.pick(index, swapped=True)
        if seq_id is None:
            return
        m = self.m
        pairs = m.swap_in(seq_id)
        swaps = m.take_window_swaps()
        if pairs is None:
            assert swaps == ([], []) and m.block_table(seq_id) == m.window_block_table(seq_id) == []
            return
        self.swapped.discard(seq_id)
        assert [d for _, d in pairs] == m.block_table(seq_id)
        assert [d for _, d in swaps.swap_in] == [b for b in m.window_block_table(seq_id) if b != NULL_BLOCK]

    @rule()
    def step_boundary(self) -> None:
        """The step's tier copies go into its batch, then its result comes back."""
        self.m.take_tier_copies()
        self.m.check_invariants()
        self.m.tier_copies_done()

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
        for event in self.m.drain_events():
            assert self.index.apply(event)
        hashes = hash_block_tokens(tokens, B)[: (len(tokens) - 1) // B]  # the match's cap: the last token is computed
        routed = self.index.tier_prefix(hashes)
        assert (routed.device, routed.device + routed.host) == (len(found.block_ids), found.num_tokens // B)

    @invariant()
    def accounted(self) -> None:
        self.m.check_invariants()
        live_window_bounded(self.m, [i for i in self.tokens if i not in self.swapped])

    def teardown(self) -> None:
        m = self.m
        for seq_id in list(self.tokens):
            m.free(seq_id)
        m.take_tier_copies()
        m.tier_copies_done()
        m.check_invariants()
        stats = m.window_stats()
        assert stats.in_use_blocks == 0 and stats.evictable_blocks == stats.cached_blocks
        assert m.stats().in_use_blocks == 0 and m.stats().host_free_blocks == m.num_host_blocks
        assert m._window.host_pool.num_free == m.num_host_blocks


HybridAmpleMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
HybridPressureMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_hybrid_group_zero_against_model = HybridAmpleMachine.TestCase
test_hybrid_under_window_pressure = HybridPressureMachine.TestCase
