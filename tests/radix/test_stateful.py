"""Hypothesis stateful test: random allocate / append / fork / cache / match / free / evict / swap / load-back /
step-boundary sequences against an independent reference model (tests/radix/radix_model.py), with and without a host
tier: exact block ids, ref counts, free queues, LRU orders and copies per tier, and every invariant after each rule.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radix.block_pool import NoFreeBlocksError
from radix.blocks import cdiv
from radix.manager import KVCacheManager, PrefixMatch, StaleMatchError
from tests.radix.radix_model import B, Model, ModelSeq
from tests.radix.radix_testing import admit, match, num_tokens, ref_count, snapshot

pytestmark = pytest.mark.slow  # seconds per test: make test-fast leaves it out

TOKENS = st.lists(st.integers(1, 3), min_size=1, max_size=9)
SALT = st.sampled_from([None, "s"])


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 16), num_host=st.integers(0, 4), num_tier=st.sampled_from([0, 1, 2, 3, 6]))
    def setup(self, num_blocks: int, num_host: int, num_tier: int) -> None:
        self.m = KVCacheManager(num_blocks, block_size=B, num_host_blocks=num_host, num_host_cache_blocks=num_tier)
        self.model = Model(num_blocks, num_host, num_tier)
        self.next_id = 0
        self.seen: list[tuple[list[int], str | None]] = []  # prompts admitted so far

    def pick(self, index: int, swapped: bool | None = False) -> int | None:
        ids = sorted(i for i, s in self.model.seqs.items() if swapped is None or (s.host is not None) == swapped)
        return ids[index % len(ids)] if ids else None

    @rule(tokens=TOKENS, salt=SALT, chunk=st.sampled_from([None, None, 1, 3]))
    def add(self, tokens: list[int], salt: str | None, chunk: int | None, taken: PrefixMatch | None = None) -> None:
        md = self.model
        matched, host_keys = md.match(tokens, salt)
        cached = (len(matched) + len(host_keys)) * B
        n_new = len(tokens) - cached if chunk is None else min(chunk, len(tokens) - cached)
        need = cdiv(cached + n_new, B) - len(matched)
        idle = sum(md.refs[b] == 1 for b in matched)
        if taken is None:
            got = admit(self.m, self.next_id, tokens, salt, n_new)
        else:
            got = self.m.add_sequence(self.next_id, taken, n_new)
        if need > len(md.free_q) + md.evictable() - idle:
            assert got is None
            return
        assert got == cached
        self.seen.append((list(tokens), salt))
        s = ModelSeq(list(tokens), salt)
        for b in matched:
            md.refs[b] += 1
        md.pin(host_keys)
        new = md.take(need)
        md.load(host_keys, new[: len(host_keys)], matched)
        s.table = matched + new
        s.cached_n = len(matched) + len(host_keys)
        s.computed = cached
        md.seqs[self.next_id] = s
        if chunk is None:  # the whole prompt is computed in one step
            self.m.commit_computed(self.next_id, len(tokens))
            s.computed = len(tokens)
            md.cache_blocks(s, len(tokens) // B)
        self.next_id += 1

    @rule(tokens=TOKENS, salt=SALT, n=st.integers(0, 2))
    def match_evict_add(self, tokens: list[int], salt: str | None, n: int) -> None:
        """The admission contract: a match taken before an eviction is refused (StaleMatchError, no side effect);
        one taken after it, or with no eviction in between, is locked exactly as taken."""
        taken = self.m.match_prefix(self.m.block_keys(tokens, salt))
        blocks, host_keys = self.model.match(tokens, salt)
        assert (taken.block_ids, taken.num_tokens) == (blocks, (len(blocks) + len(host_keys)) * B)
        evicted = 0
        for _ in range(n):
            evicted += self.model.evict_one()
        assert len(self.m.tree.evict(n)) == evicted
        self.m.drain_events()
        if evicted:
            assert not self.m.is_current(taken)
            with pytest.raises(StaleMatchError):
                self.m.add_sequence(self.next_id, taken)
            return  # agrees_with_model checks that nothing changed
        assert self.m.is_current(taken)
        self.add(tokens, salt, None, taken)

    @rule(tokens=TOKENS, salt=SALT)
    def finished_request(self, tokens: list[int], salt: str | None) -> None:
        """A whole request in one go (admit, compute the prompt, free): fills the cache with idle leaves."""
        seq_id = self.next_id
        self.add(tokens, salt, None)
        if seq_id in self.model.seqs:
            self.free(seq_id, None, exact=True)

    @rule(index=st.integers(0, 50), extra=st.lists(st.integers(1, 3), max_size=3))
    def follow_up(self, index: int, extra: list[int]) -> None:
        """A later turn: an earlier prompt (maybe evicted, maybe on the host tier) plus a few tokens."""
        if self.seen:
            tokens, salt = self.seen[index % len(self.seen)]
            self.finished_request(tokens + extra, salt)

    @rule(index=st.integers(0, 50), n=st.integers(1, 6), extra=st.lists(st.integers(1, 3), max_size=2))
    def evicted_then_back(self, index: int, n: int, extra: list[int]) -> None:
        """Pressure pushes cached blocks out (to the host tier when there is one), then a later turn wants them."""
        self.evict(n)
        self.follow_up(index, extra)

    @rule(index=st.integers(0, 50), chunk=st.integers(1, 3), token=st.integers(1, 3))
    def step(self, index: int, chunk: int, token: int) -> None:
        """One forward step: a prefill chunk, or a decode token (append first). allocate, copy-on-write, commit."""
        seq_id = self.pick(index)
        if seq_id is None:
            return
        md = self.model
        s = self.model.seqs[seq_id]
        if s.computed == len(s.tokens):
            self.m.append_tokens(seq_id, [token])
            s.tokens.append(token)
            chunk = 1
        n = min(chunk, len(s.tokens) - s.computed)
        need = cdiv(s.computed + n, B) - len(s.table)
        got = self.m.allocate(seq_id, n)
        if need > len(md.free_q) + md.evictable():
            assert got is None
            return
        new = md.take(max(need, 0))
        assert got == new
        s.table += new
        start = s.computed
        end = s.computed + n
        shared = [i for i in range(start // B, cdiv(end, B)) if md.refs[s.table[i]] > 1]
        if len(shared) > len(md.free_q) + md.evictable():
            try:
                self.m.prepare_write(seq_id, start, end)
                raise AssertionError("prepare_write should have raised NoFreeBlocksError")
            except NoFreeBlocksError:
                return
        pairs = self.m.prepare_write(seq_id, start, end)
        dsts = md.take(len(shared))
        assert pairs == [(s.table[i], d) for i, d in zip(shared, dsts, strict=True)]
        srcs = [s.table[i] for i in shared]
        for i, d in zip(shared, dsts, strict=True):
            s.table[i] = d
        md.release(srcs)
        self.m.commit_computed(seq_id, end)
        s.computed = end
        md.cache_blocks(s, end // B)

    @rule(index=st.integers(0, 50))
    def fork(self, index: int) -> None:
        parent = self.pick(index)
        if parent is None:
            return
        md = self.model
        p = self.model.seqs[parent]
        self.m.fork(parent, self.next_id)
        c = ModelSeq(list(p.tokens), p.salt)
        c.table = list(p.table)
        c.pins = list(p.pins)
        c.computed = p.computed
        c.cached_n = p.cached_n
        for b in c.table + c.pins:
            md.refs[b] += 1
        md.seqs[self.next_id] = c
        self.next_id += 1

    @rule(index=st.integers(0, 50), keep=st.one_of(st.none(), st.integers(0, 12)))
    def free(self, index: int, keep: int | None, exact: bool = False) -> None:
        seq_id = index if exact else self.pick(index, swapped=None)
        if seq_id is None:
            return
        md = self.model
        s = md.seqs.pop(seq_id)
        self.m.free(seq_id, keep)
        if s.host is not None:
            md.host_q.extend(s.host)
            return
        limit = s.computed if keep is None else min(s.computed, keep)
        md.cache_blocks(s, limit // B)
        if keep is not None:
            md.uncache_past(s, keep // B)
        md.release(s.table + s.pins)

    @rule(n=st.integers(1, 4))
    def evict(self, n: int) -> None:
        freed_before = list(self.model.free_q)
        for _ in range(n):
            if not self.model.evict_one():
                break
        expected = list(self.model.free_q)[len(freed_before) :]
        assert self.m.tree.evict(n) == expected
        self.m.drain_events()

    @rule(tokens=TOKENS, salt=SALT)
    def match(self, tokens: list[int], salt: str | None) -> None:
        blocks, host_keys = self.model.match(tokens, salt)
        assert match(self.m, tokens, salt) == (blocks, (len(blocks) + len(host_keys)) * B)
        found = self.m.match_prefix(self.m.block_keys(tokens, salt))
        assert [n.host_block for n in found.host_nodes] == [self.model.cache[k].host for k in host_keys]

    @rule()
    def step_boundary(self) -> None:
        """The scheduler's step edge: the step's tier copies go into its batch, then its result comes back."""
        assert tuple(self.m.take_tier_copies()) == self.model.take_copies()
        self.m.check_invariants()
        self.m.tier_copies_done()
        self.model.copies_done()

    @rule(index=st.integers(0, 50))
    def swap_out(self, index: int) -> None:
        seq_id = self.pick(index)
        if seq_id is None:
            return
        md = self.model
        s = self.model.seqs[seq_id]
        pairs = self.m.swap_out(seq_id)
        if len(s.table) > len(md.host_q):
            assert pairs is None
            return
        host = [md.host_q.popleft() for _ in s.table]
        assert pairs == list(zip(s.table, host, strict=True))
        md.release(s.table + s.pins)
        s.host = host
        s.table = []
        s.pins = []
        s.cached_n = 0

    @rule(index=st.integers(0, 50))
    def swap_in(self, index: int) -> None:
        seq_id = self.pick(index, swapped=True)
        if seq_id is None:
            return
        md = self.model
        s = self.model.seqs[seq_id]
        pairs = self.m.swap_in(seq_id)
        if len(s.host) > len(md.free_q) + md.evictable():
            assert pairs is None
            return
        device = md.take(len(s.host))
        assert pairs == list(zip(s.host, device, strict=True))
        md.host_q.extend(s.host)
        s.table = device
        s.host = None

    @invariant()
    def agrees_with_model(self) -> None:
        m = self.m
        md = self.model
        m.check_invariants()
        assert [ref_count(m, b) for b in md.refs] == list(md.refs.values())
        assert m._pool.free_block_ids() == list(md.free_q)
        assert m._host_pool.free_block_ids() == list(md.host_q)
        assert m.tree.lru_order() == md.device_lru() and m.tree.host_lru_order() == md.host_lru()
        tier = m._tier
        assert (tier is not None) == md.tier
        if tier is not None:
            assert tier.pool.free_block_ids() == list(md.tier_q) and tier.pins() == md.pinned
            assert tier.pool.ref_counts == list(md.tier_refs.values()) and tier.loading == md.loading
        host_cached = sorted(e.host for e in md.cache.values() if e.host is not None)
        assert sorted(m.tree.host_block(h) for h in m.kv_snapshot().host_block_hashes) == host_cached
        assert m.stats().host_cached_blocks == len(host_cached)
        device = md.device()
        free = {b for b, r in md.refs.items() if r == 0}
        evictable = {b for b in device.values() if md.refs[b] == 1}
        in_use = {b for b, r in md.refs.items() if r >= 1} - evictable
        assert len(free) + len(evictable) + len(in_use) == md.usable
        stats = m.stats()
        assert (stats.free_blocks, stats.evictable_blocks, stats.in_use_blocks) == (
            len(free),
            len(evictable),
            len(in_use),
        )
        assert stats.cached_blocks == len(device)
        assert sorted(m.tree.resident_block(h) for h in snapshot(m)) == sorted(device.values())
        for key in md.cache:  # no cached child without its parent; device residency is prefix-closed
            assert len(key[1]) == B or (key[0], key[1][:-B]) in md.cache
            assert key not in device or len(key[1]) == B or (key[0], key[1][:-B]) in device
        for seq_id, s in md.seqs.items():
            assert m.block_table(seq_id) == s.table
            assert m.num_computed_tokens(seq_id) == s.computed and num_tokens(m, seq_id) == len(s.tokens)
            for b in s.table:
                assert ref_count(m, b) >= 1 and b not in free
            if s.host is None:
                assert m.waits_for_loads(seq_id) == any(b in md.loading for b in s.table[: s.cached_n])


KVCacheMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_kv_cache_manager_against_model = KVCacheMachine.TestCase
