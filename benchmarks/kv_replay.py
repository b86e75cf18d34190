"""The replay behind benchmarks/kv_memory.py: a contiguous allocator that reserves the max context per sequence
(the pre-paging design) and the paged radix/ KVCacheManager, each under the same drawn requests, admitted at their
final length (static_replay) or run under continuous batching one token per step (ContiguousSim, PagedSim), with the
KV slots each holds split into live tokens, reservation, internal and external fragmentation and free slots."""

from __future__ import annotations

import bisect
import collections
import random
import statistics

from radix.blocks import cdiv
from radix.manager import KVCacheManager

VOCAB = 49152


class ContiguousAllocator:
    """First-fit allocator of `reserve` contiguous slots per sequence over [0, capacity) slots (pre-paging design).

    Holes are kept sorted by start; allocate/free are O(holes).
    """

    def __init__(self, capacity: int, reserve: int) -> None:
        self.capacity = capacity
        self.reserve = reserve
        self.holes: list[tuple[int, int]] = [(0, capacity)]  # (start, length), sorted, never adjacent
        self.owned: dict[int, int] = {}  # seq_id -> start slot

    def allocate(self, seq_id: int) -> bool:
        """Reserve `reserve` slots for seq_id in the first hole that holds them; False (no change) if none does."""
        for i, (start, length) in enumerate(self.holes):
            if length >= self.reserve:
                self.owned[seq_id] = start
                if length == self.reserve:
                    del self.holes[i]
                else:
                    self.holes[i] = (start + self.reserve, length - self.reserve)
                return True
        return False

    def free(self, seq_id: int) -> None:
        """Return seq_id's slots, merging with neighbouring holes. Raises KeyError for an unknown seq_id."""
        start = self.owned.pop(seq_id)
        length = self.reserve
        i = bisect.bisect(self.holes, (start, 0))
        if i < len(self.holes) and start + length == self.holes[i][0]:
            length += self.holes.pop(i)[1]
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == start:
            prev_start, prev_length = self.holes[i - 1]
            self.holes[i - 1] = (prev_start, prev_length + length)
        else:
            self.holes.insert(i, (start, length))

    def free_slots(self, min_hole: int = 0) -> int:
        """Free slots in holes of at least min_hole slots."""
        return sum(length for _, length in self.holes if length >= min_hole)


def draw_requests(n: int, mean_len: int, max_len: int, seed: int) -> list[tuple[int, int]]:
    """n (prompt_len, final_len) pairs: final_len ~ Gamma(shape 2), rescaled so the sample mean is mean_len, rounded
    and clipped to [2, max_len]; prompt_len = max(1, final_len // 4). Seeded with `seed`."""
    rng = random.Random(seed)
    raw = [rng.gammavariate(2.0, 1.0) for _ in range(n)]
    scale = mean_len / statistics.mean(raw)
    lengths = [min(max_len, max(2, round(x * scale))) for x in raw]
    return [(max(1, length // 4), length) for length in lengths]


def token_ids(i: int, n: int) -> list[int]:
    """n token ids of request i: deterministic, distinct between requests (no prefix is shared)."""
    return [(i * 7919 + j * 31) % VOCAB for j in range(n)]


def static_replay(
    requests: list[tuple[int, int]], num_blocks: int, block_size: int, max_len: int, trials: int = 50, seed: int = 0
) -> dict:
    """The design notes' arithmetic: admit requests at their final length, in order, until one does not fit; the mean
    over `trials` shuffled orders of the requests."""
    capacity = num_blocks * block_size
    rng = random.Random(seed)
    rows: dict[str, list[tuple[int, int, float]]] = {"contiguous": [], "paged": []}
    for _ in range(trials):
        order = rng.sample(range(len(requests)), len(requests))
        contiguous = ContiguousAllocator(capacity, max_len)
        lens = []
        for i in order:
            if not contiguous.allocate(i):
                break
            lens.append(requests[i][1])
        rows["contiguous"].append((len(lens), sum(lens), 0.0))
        mgr = KVCacheManager(num_blocks + 1, block_size, enable_prefix_caching=False)
        lens = []
        for i in order:
            length = requests[i][1]
            if mgr.add_sequence(i, mgr.match_prefix(mgr.block_keys(token_ids(i, length)))) is None:
                break
            mgr.commit_computed(i, length)
            lens.append(length)
        rows["paged"].append((len(lens), sum(lens), mgr.stats().waste_slots / len(lens)))
    out = {}
    for name, rs in rows.items():
        out[name] = {
            "concurrent_sequences": round(statistics.mean(r[0] for r in rs), 2),
            "live_fraction": round(statistics.mean(r[1] for r in rs) / capacity, 4),
            "mean_len": round(sum(r[1] for r in rs) / sum(r[0] for r in rs), 1),
        }
    out["paged"]["waste_per_seq_tokens"] = round(statistics.mean(r[2] for r in rows["paged"]), 2)
    out["trials"] = trials
    return out


class _Sim:
    """Continuous batching over one allocator; subclasses say how memory is taken and what a snapshot holds."""

    def __init__(self, requests: list[tuple[int, int]], capacity: int) -> None:
        self.requests = requests
        self.capacity = capacity
        self.queue = collections.deque(range(len(requests)))
        self.running: list[int] = []  # admission order
        self.computed = [0] * len(requests)  # tokens with KV written
        self.resume = [p for p, _ in requests]  # tokens to prefill at (re-)admission
        self.samples: list[dict[str, float]] = []
        self.steps = self.preemptions = self.recomputed_tokens = self.decode_tokens = 0

    def run(self) -> None:
        while self.queue or self.running:
            self.admit()
            if self.queue:
                self.samples.append(self.snapshot())
            self.decode()
            self.steps += 1

    def admit(self) -> None:
        while self.queue and self.try_admit(self.queue[0]):
            i = self.queue.popleft()
            self.running.append(i)
            self.computed[i] = self.resume[i]

    def decode(self) -> None:
        for i in list(self.running):
            if i not in self.running:
                continue  # preempted earlier in this step
            if self.computed[i] >= self.requests[i][1]:
                self.finish(i)
            elif self.grow(i):
                self.computed[i] += 1
                self.decode_tokens += 1

    def preempt(self, i: int) -> None:
        self.running.remove(i)
        self.preemptions += 1
        self.recomputed_tokens += self.computed[i]
        self.resume[i] = self.computed[i]
        self.queue.appendleft(i)

    def summary(self) -> dict:
        mean = {k: statistics.mean(s[k] for s in self.samples) for k in self.samples[0]}
        frac = {k: round(mean[k] / self.capacity, 4) for k in ("live", "reservation", "internal", "external", "free")}
        return {
            "concurrent_sequences_mean": round(mean["running"], 2),
            "concurrent_sequences_max": max(int(s["running"]) for s in self.samples),
            "live_fraction": frac["live"],
            "waste_fraction": {k: frac[k] for k in ("reservation", "internal", "external")},
            "free_fraction": frac["free"],
            "steps": self.steps,
            "decode_tokens_per_step": round(self.decode_tokens / self.steps, 2),
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
            "measured_steps": len(self.samples),
        }


class ContiguousSim(_Sim):
    """Each admitted request reserves max_len contiguous slots for its whole life: it never preempts."""

    def __init__(self, requests: list[tuple[int, int]], capacity: int, max_len: int) -> None:
        super().__init__(requests, capacity)
        self.alloc = ContiguousAllocator(capacity, max_len)
        self.max_len = max_len

    def try_admit(self, i: int) -> bool:
        return self.alloc.allocate(i)

    def grow(self, i: int) -> bool:
        return True

    def finish(self, i: int) -> None:
        self.running.remove(i)
        self.alloc.free(i)

    def snapshot(self) -> dict[str, float]:
        live = sum(self.computed[i] for i in self.running)
        final = sum(self.requests[i][1] for i in self.running)
        small_holes = self.alloc.free_slots() - self.alloc.free_slots(self.max_len)
        return {
            "running": len(self.running),
            "live": live,
            "reservation": final - live,
            "internal": self.max_len * len(self.running) - final,
            "external": small_holes,
            "free": self.alloc.free_slots(self.max_len),
        }


class PagedSim(_Sim):
    """The real KVCacheManager (prefix caching off: the requests share nothing), driven like
    runtime/scheduler/scheduler.py."""

    def __init__(self, requests: list[tuple[int, int]], num_blocks: int, block_size: int) -> None:
        super().__init__(requests, num_blocks * block_size)
        self.mgr = KVCacheManager(num_blocks + 1, block_size, enable_prefix_caching=False)
        self.block_size = block_size
        self.admitted_at: dict[int, int] = {}
        self.tail: list[float] = []  # mean waste per sequence at each snapshot
        self.tail_max = 0  # largest waste of one sequence at any snapshot

    def try_admit(self, i: int) -> bool:
        n = self.resume[i]
        if not self.mgr.can_allocate(cdiv(n, self.block_size)):
            return False
        if self.mgr.add_sequence(i, self.mgr.match_prefix(self.mgr.block_keys(token_ids(i, n)))) is None:
            return False
        self.mgr.commit_computed(i, n)
        self.admitted_at[i] = self.steps * len(self.requests) + len(self.admitted_at)
        return True

    def grow(self, i: int) -> bool:
        pos = self.computed[i]
        while self.mgr.allocate(i, 1) is None:
            victim = max(self.running, key=lambda s: self.admitted_at[s])
            self.mgr.free(victim)
            self.preempt(victim)
            if victim == i:
                return False
        assert self.mgr.prepare_write(i, pos, pos + 1) == []  # no sharing here, so no copy-on-write
        self.mgr.append_tokens(i, token_ids(i, pos + 1)[pos:])
        self.mgr.commit_computed(i, pos + 1)
        return True

    def finish(self, i: int) -> None:
        self.running.remove(i)
        self.mgr.free(i)

    def snapshot(self) -> dict[str, float]:
        stats = self.mgr.stats()
        live = sum(self.computed[i] for i in self.running)
        free = stats.free_blocks * self.block_size
        assert live + stats.waste_slots + free == self.capacity, "slots do not add up"
        if self.running:
            self.tail.append(stats.waste_slots / len(self.running))
            bs = self.block_size
            self.tail_max = max(
                self.tail_max, max(len(self.mgr.block_table(i)) * bs - self.computed[i] for i in self.running)
            )
        return {
            "running": len(self.running),
            "live": live,
            "reservation": 0,
            "internal": stats.waste_slots,
            "external": 0,
            "free": free,
        }

    def summary(self) -> dict:
        out = super().summary()
        bs = self.block_size
        out["waste_per_seq_tokens"] = {
            "mean": round(statistics.mean(self.tail), 2),
            "max": self.tail_max,
            "max_step_mean": round(max(self.tail), 2),
            "expected_bound": (bs - 1) / 2,
            "max_bound": bs - 1,
        }
        return out
