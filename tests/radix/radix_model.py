"""The reference model of the KVCacheManager that tests/radix/test_stateful.py checks it against.

It shares no code with radix/: no tree and no hashing. Its cache is a brute-force dict from cached token prefixes
(salt, tokens of the first k full blocks) to an Entry (device block or None, host block or None); ref counts are
dicts; the free queues are deques. Eviction picks, by linear scan, the least recently released cached prefix that is
idle on the device and has no device-resident extension; with a host tier it is written back to a host block (a free
one, else the least recently used droppable host copy is dropped for it) or, when none can be had, dropped with its
extensions. It predicts every block id, ref count, copy and match the manager produces, exactly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

B = 2  # block size: small so that prompts share and split blocks often


@dataclass
class Entry:
    dev: int | None
    host: int | None = None


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
    """Reference: brute force over a dict of cached prefixes, two tiers."""

    def __init__(self, num_blocks: int, num_host: int, num_tier: int = 0) -> None:
        self.usable = num_blocks - 1
        self.refs = dict.fromkeys(range(1, num_blocks), 0)
        self.free_q = deque(range(1, num_blocks))
        self.host_q = deque(range(num_host))
        self.num_host = num_host
        self.tier = num_tier > 0
        self.tier_refs = dict.fromkeys(range(num_tier), 0)
        self.tier_q = deque(range(num_tier))
        self.cache: dict[tuple, Entry] = {}  # (salt, token prefix) -> its blocks
        self.last: dict[tuple, int] = {}
        self.host_key: dict[tuple, tuple[int, int]] = {}  # host LRU key: (last access, host block)
        self.clock = 0
        self.seqs: dict[int, ModelSeq] = {}
        self.pinned: dict[int, int] = {}  # host block -> pending copies, in first-pin order
        self.loading: set[int] = set()
        self.device_pins: list[int] = []
        self.write_back: list[tuple[int, int]] = []
        self.load_back: list[tuple[int, int]] = []

    def key(self, salt: str | None, tokens: list[int], nblocks: int) -> tuple:
        return (salt, tuple(tokens[: nblocks * B]))

    def cached_key_of(self, block: int) -> tuple | None:
        return next((k for k, e in self.cache.items() if e.dev == block), None)

    def children(self, key: tuple) -> list[tuple]:
        n = len(key[1])
        return [k for k in self.cache if k[0] == key[0] and len(k[1]) == n + B and k[1][:n] == key[1]]

    def device(self) -> dict[tuple, int]:
        return {k: e.dev for k, e in self.cache.items() if e.dev is not None}

    def evictable(self) -> int:
        return sum(self.refs[b] == 1 for b in self.device().values())

    def device_lru(self) -> list[int]:
        leaves = [
            k
            for k, b in self.device().items()
            if self.refs[b] == 1 and all(self.cache[c].dev is None for c in self.children(k))
        ]
        return [self.cache[k].dev for k in sorted(leaves, key=lambda k: (self.last[k], self.cache[k].dev))]

    def host_lru(self) -> list[int]:
        droppable = [
            k
            for k, e in self.cache.items()
            if e.host is not None and self.tier_refs[e.host] == 1 and (e.dev is not None or not self.children(k))
        ]
        return [self.cache[k].host for k in sorted(droppable, key=lambda k: self.host_key[k])]

    # ----------------------------------------------------------------- matching and eviction
    def match(self, tokens: list[int], salt: str | None) -> tuple[list[int], list[tuple]]:
        """(device blocks of the matched prefix, keys of the host-only blocks after them)."""
        blocks: list[int] = []
        host: list[tuple] = []
        for k in range(1, (len(tokens) - 1) // B + 1):
            key = self.key(salt, tokens, k)
            entry = self.cache.get(key)
            if entry is None:
                break
            if entry.dev is not None:
                blocks.append(entry.dev)
            else:
                host.append(key)
        return blocks, host

    def evict_one(self) -> bool:
        lru = self.device_lru()
        if not lru:
            return False
        block = lru[0]
        victim = self.cached_key_of(block)
        assert victim is not None
        entry = self.cache[victim]
        if not self.tier:
            del self.cache[victim], self.last[victim]
        elif entry.host is None:
            host = self.tier_slot()
            if host is None:
                self.drop_with_extensions(victim)
            else:
                entry.host = host
                self.tier_refs[host] = 2  # the tree's copy + the pending write-back's pin
                self.pinned[host] = self.pinned.get(host, 0) + 1
                self.write_back.append((block, host))
                self.host_key[victim] = (self.last[victim], host)
                entry.dev = None
        else:
            entry.dev = None
        self.refs[block] = 0
        self.free_q.append(block)
        return True

    def tier_slot(self) -> int | None:
        if not self.tier_q:
            lru = self.host_lru()
            if not lru:
                return None
            victim = next(k for k, e in self.cache.items() if e.host == lru[0])
            self.drop_host(victim)
            if self.cache[victim].dev is None:
                del self.cache[victim]
        host = self.tier_q.popleft()
        self.tier_refs[host] = 1
        return host

    def drop_host(self, key: tuple) -> None:
        host = self.cache[key].host
        assert host is not None
        self.cache[key].host = None
        self.tier_refs[host] -= 1
        if self.tier_refs[host] == 0:
            self.tier_q.append(host)

    def drop_with_extensions(self, key: tuple) -> None:
        """key (a device leaf) leaves with every cached extension (all host-only), deepest first, by host block."""
        n = len(key[1])
        below = [k for k in self.cache if k[0] == key[0] and len(k[1]) > n and k[1][:n] == key[1]]
        for k in sorted(below, key=lambda k: (-len(k[1]), self.cache[k].host)):
            self.drop_host(k)
            del self.cache[k]
        del self.cache[key]

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

    # ----------------------------------------------------------------- loads and copies
    def pin(self, keys: list[tuple]) -> None:
        for key in keys:
            host = self.cache[key].host
            assert host is not None
            self.tier_refs[host] += 1
            self.pinned[host] = self.pinned.get(host, 0) + 1

    def load(self, keys: list[tuple], blocks: list[int], prefix: list[int]) -> None:
        """Load keys into blocks under the device prefix; the load holds the whole path until copies_done."""
        if keys:
            self.clock += 1
            for b in prefix + blocks:
                self.refs[b] += 1
            self.device_pins += prefix + blocks
        for key, block in zip(keys, blocks, strict=True):
            entry = self.cache[key]
            assert entry.host is not None
            entry.dev = block
            self.refs[block] += 1  # the cache's reference beside the sequence's (and the pin)
            self.load_back.append((entry.host, block))
            self.loading.add(block)
            self.host_key[key] = (self.clock, entry.host)

    def copies_done(self) -> None:
        if self.device_pins:
            self.release(self.device_pins)
            self.device_pins = []
        for host, count in self.pinned.items():
            self.tier_refs[host] -= count
            if self.tier_refs[host] == 0:
                self.tier_q.append(host)
        self.pinned = {}
        self.loading = set()

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        off = self.num_host
        out = ([(d, h + off) for d, h in self.write_back], [(h + off, d) for h, d in self.load_back])
        self.write_back = []
        self.load_back = []
        return out

    # ----------------------------------------------------------------- caching
    def cache_blocks(self, s: ModelSeq, nfull: int) -> None:
        for i in range(s.cached_n, min(nfull, len(s.table))):
            key = self.key(s.salt, s.tokens, i + 1)
            entry = self.cache.get(key)
            if entry is not None and entry.dev is None:  # on the host only: s's block becomes its device copy
                entry.dev = s.table[i]
                self.refs[s.table[i]] += 1
            elif entry is not None:
                resident = entry.dev
                assert resident is not None
                if resident != s.table[i] and self.refs[resident] == 1:  # idle: the cache takes s's copy instead
                    self.refs[resident] = 0
                    self.free_q.append(resident)
                    entry.dev = s.table[i]
                    self.refs[s.table[i]] += 1
                elif resident != s.table[i]:
                    self.refs[resident] += 1
                    s.pins.append(resident)
            else:
                self.cache[key] = Entry(s.table[i])
                self.last[key] = self.clock
                self.refs[s.table[i]] += 1
            s.cached_n = i + 1

    def uncache_past(self, s: ModelSeq, keep_blocks: int) -> None:
        for i in range(s.cached_n - 1, keep_blocks - 1, -1):
            key = self.key(s.salt, s.tokens, i + 1)
            entry = self.cache.get(key)
            if entry is None or entry.dev != s.table[i] or self.refs[s.table[i]] != 2 or self.children(key):
                break
            if entry.host is not None:
                self.drop_host(key)
            del self.cache[key]
            self.last.pop(key, None)
            self.refs[s.table[i]] -= 1
            s.cached_n = i
