"""Hypothesis stateful test: random allocate / append / fork / cache / match / free / evict / swap sequences against
an independent reference model.

The model shares no code with radix/: no tree and no hashing. Its cache is a brute-force dict from cached token
prefixes (salt, tokens of the first k full blocks) to block ids; ref counts are a dict; the free queues are deques;
LRU eviction picks, by linear scan, the least recently released cached prefix that is idle and has no cached
extension. It predicts every block id the manager hands out, every ref count and every match, exactly.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from radix_testing import admit, match, ref_count, snapshot

from radix.block_pool import NoFreeBlocksError
from radix.manager import KVCacheManager, PrefixMatch, StaleMatchError

B = 2  # block size: small so that prompts share and split blocks often
TOKENS = st.lists(st.integers(1, 3), min_size=1, max_size=9)
SALT = st.sampled_from([None, "s"])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ModelSeq:
    def __init__(self, tokens: list[int], salt: str | None) -> None:
        self.tokens = tokens
        self.salt = salt
        self.table: list[int] = []
        self.pins: list[int] = []  # resident duplicates in use that the sequence also holds
        self.computed = 0
        self.cached_n = 0  # leading blocks already entered in the cache
        self.host: list[int] | None = None


class Model:
    """Reference: brute force over a dict of cached prefixes."""

    def __init__(self, num_blocks: int, num_host: int) -> None:
        self.usable = num_blocks - 1
        self.refs = dict.fromkeys(range(1, num_blocks), 0)
        self.free_q = deque(range(1, num_blocks))
        self.host_q = deque(range(num_host))
        self.cache: dict[tuple, int] = {}  # (salt, token prefix) -> block
        self.last: dict[tuple, int] = {}
        self.clock = 0
        self.seqs: dict[int, ModelSeq] = {}

    def key(self, salt: str | None, tokens: list[int], nblocks: int) -> tuple:
        return (salt, tuple(tokens[: nblocks * B]))

    def cached_key_of(self, block: int) -> tuple | None:
        return next((k for k, b in self.cache.items() if b == block), None)

    def has_child(self, key: tuple) -> bool:
        n = len(key[1])
        return any(k[0] == key[0] and len(k[1]) == n + B and k[1][:n] == key[1] for k in self.cache)

    def evictable(self) -> int:
        return sum(self.refs[b] == 1 for b in self.cache.values())

    def match(self, tokens: list[int], salt: str | None) -> list[int]:
        blocks = []
        for k in range(1, (len(tokens) - 1) // B + 1):
            block = self.cache.get(self.key(salt, tokens, k))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def evict_one(self) -> bool:
        leaves = [k for k, b in self.cache.items() if self.refs[b] == 1 and not self.has_child(k)]
        if not leaves:
            return False
        victim = min(leaves, key=lambda k: (self.last[k], self.cache[k]))
        block = self.cache.pop(victim)
        del self.last[victim]
        self.refs[block] = 0
        self.free_q.append(block)
        return True

    def take(self, n: int) -> list[int]:
        for _ in range(n - len(self.free_q)):
            assert self.evict_one()
        blocks = [self.free_q.popleft() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        self.clock += 1
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_q.append(b)
            elif self.refs[b] == 1:
                key = self.cached_key_of(b)
                if key is not None:
                    self.last[key] = self.clock

    def cache_blocks(self, s: ModelSeq, nfull: int) -> None:
        for i in range(s.cached_n, min(nfull, len(s.table))):
            key = self.key(s.salt, s.tokens, i + 1)
            if key in self.cache:
                resident = self.cache[key]
                if resident != s.table[i] and self.refs[resident] == 1:  # idle: the cache takes s's copy instead
                    self.refs[resident] = 0
                    self.free_q.append(resident)
                    self.cache[key] = s.table[i]
                    self.refs[s.table[i]] += 1
                elif resident != s.table[i]:
                    self.refs[resident] += 1
                    s.pins.append(resident)
            else:
                self.cache[key] = s.table[i]
                self.last[key] = self.clock
                self.refs[s.table[i]] += 1
            s.cached_n = i + 1

    def uncache_past(self, s: ModelSeq, keep_blocks: int) -> None:
        for i in range(s.cached_n - 1, keep_blocks - 1, -1):
            key = self.key(s.salt, s.tokens, i + 1)
            if self.cache.get(key) != s.table[i] or self.refs[s.table[i]] != 2 or self.has_child(key):
                break
            del self.cache[key], self.last[key]
            self.refs[s.table[i]] -= 1
            s.cached_n = i


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 16), num_host=st.integers(0, 4))
    def setup(self, num_blocks: int, num_host: int) -> None:
        self.m = KVCacheManager(num_blocks, block_size=B, num_host_blocks=num_host)
        self.model = Model(num_blocks, num_host)
        self.next_id = 0

    def pick(self, index: int, swapped: bool | None = False) -> int | None:
        ids = sorted(i for i, s in self.model.seqs.items() if swapped is None or (s.host is not None) == swapped)
        return ids[index % len(ids)] if ids else None

    @rule(tokens=TOKENS, salt=SALT, chunk=st.sampled_from([None, None, 1, 3]))
    def add(self, tokens: list[int], salt: str | None, chunk: int | None, taken: PrefixMatch | None = None) -> None:
        md = self.model
        matched = md.match(tokens, salt)
        cached = len(matched) * B
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
        s = ModelSeq(list(tokens), salt)
        for b in matched:
            md.refs[b] += 1
        s.table = matched + md.take(need)
        s.cached_n, s.computed = len(matched), cached
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
        assert (taken.block_ids, taken.num_tokens) == (self.model.match(tokens, salt), len(taken.block_ids) * B)
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

    @rule(index=st.integers(0, 50), chunk=st.integers(1, 3), token=st.integers(1, 3))
    def step(self, index: int, chunk: int, token: int) -> None:
        """One forward step: a prefill chunk, or a decode token (append first). allocate, copy-on-write, commit."""
        seq_id = self.pick(index)
        if seq_id is None:
            return
        md, s = self.model, self.model.seqs[seq_id]
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
        start, end = s.computed, s.computed + n
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
        md, p = self.model, self.model.seqs[parent]
        self.m.fork(parent, self.next_id)
        c = ModelSeq(list(p.tokens), p.salt)
        c.table, c.pins, c.computed, c.cached_n = list(p.table), list(p.pins), p.computed, p.cached_n
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
        blocks = self.model.match(tokens, salt)
        assert match(self.m, tokens, salt) == (blocks, len(blocks) * B)

    @rule(index=st.integers(0, 50))
    def swap_out(self, index: int) -> None:
        seq_id = self.pick(index)
        if seq_id is None:
            return
        md, s = self.model, self.model.seqs[seq_id]
        pairs = self.m.swap_out(seq_id)
        if len(s.table) > len(md.host_q):
            assert pairs is None
            return
        host = [md.host_q.popleft() for _ in s.table]
        assert pairs == list(zip(s.table, host, strict=True))
        md.release(s.table + s.pins)
        s.host, s.table, s.pins, s.cached_n = host, [], [], 0

    @rule(index=st.integers(0, 50))
    def swap_in(self, index: int) -> None:
        seq_id = self.pick(index, swapped=True)
        if seq_id is None:
            return
        md, s = self.model, self.model.seqs[seq_id]
        pairs = self.m.swap_in(seq_id)
        if len(s.host) > len(md.free_q) + md.evictable():
            assert pairs is None
            return
        device = md.take(len(s.host))
        assert pairs == list(zip(s.host, device, strict=True))
        md.host_q.extend(s.host)
        s.table, s.host = device, None

    @invariant()
    def agrees_with_model(self) -> None:
        m, md = self.m, self.model
        m.check_invariants()
        assert [ref_count(m, b) for b in md.refs] == list(md.refs.values())
        assert m._pool.free_block_ids() == list(md.free_q)
        assert m._host_pool.free_block_ids() == list(md.host_q)
        free = {b for b, r in md.refs.items() if r == 0}
        evictable = {b for b in md.cache.values() if md.refs[b] == 1}
        in_use = {b for b, r in md.refs.items() if r >= 1} - evictable
        assert len(free) + len(evictable) + len(in_use) == md.usable
        stats = m.stats()
        assert (stats.free_blocks, stats.evictable_blocks, stats.in_use_blocks) == (
            len(free), len(evictable), len(in_use)
        )  # fmt: skip
        assert stats.cached_blocks == len(md.cache)
        assert sorted(m.tree.resident_block(h) for h in snapshot(m)) == sorted(md.cache.values())
        for key in md.cache:  # no cached child without its parent
            assert len(key[1]) == B or (key[0], key[1][:-B]) in md.cache
        for seq_id, s in md.seqs.items():
            assert m.block_table(seq_id) == s.table
            assert m.num_computed_tokens(seq_id) == s.computed and m.num_tokens(seq_id) == len(s.tokens)
            for b in s.table:
                assert ref_count(m, b) >= 1 and b not in free


KVCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_kv_cache_manager_against_model = KVCacheMachine.TestCase
