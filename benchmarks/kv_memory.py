"""KV memory: paged blocks (the real radix/ KVCacheManager) against a contiguous allocator sized for the max context.

Replays the worked estimate of the design notes ("PagedAttention and the KV memory manager"): a pool of 1,000 KV
blocks of 16 tokens (16,000 token slots), a 2,048-token maximum context, request lengths drawn with mean 300 tokens.
The contiguous allocator reserves 2,048 contiguous slots per admitted request (first fit over the slot address
space); the paged side is radix.manager.KVCacheManager (num_blocks = 1,001: block 0 is the reserved null block, so
both sides hold 16,000 slots), driven with the operations the scheduler performs (runtime/scheduler/scheduler.py): admit
with add_sequence once the whole prompt's blocks fit, commit_computed after each step, allocate + prepare_write one slot
per decode step, preempt the most recently admitted sequence by recompute when a block cannot be had, free at the end.

Three measurements (every figure is a slot count over the 16,000 slots, or a fraction of them):
- static: the design notes' arithmetic, replayed: requests at their final length admitted in order until one does
  not fit. Contiguous: floor(16000 / 2048) = 7 sequences; paged: about 16000 / (300 + 7.5) sequences.
- dynamic: continuous batching of `--requests` requests (one prefill step, then one token per step), averaged over
  the steps at which a request waits for memory (the memory-bound steady state). Waste is split into
  reservation (slots reserved for tokens the sequence has not produced yet), internal fragmentation (reserved slots
  past the sequence's final length; for paged, the unfilled tail of the last block) and external fragmentation (free
  slots in holes too small for the waiting request). For paged, the mean waste per sequence is compared with the
  (B - 1) / 2 = 7.5 expected tail of a uniform L mod B, and its maximum with B - 1 (Kwon et al., SOSP 2023, sec. 4.2).
- parallel sampling: n = 4 samples over one shared 512-token prompt, forked as the scheduler forks them (prefill of
  prompt[:-1], fork, each child writes the last prompt token through prepare_write: copy-on-write of the shared
  partial block), against 4 full copies; blocks in use after the prompt and at the end of generation.
- beam search (benchmarks/beam_memory.py): the real Engine on a model (default the embedded SmolLM2), K = 2, 4, 8
  beams, 3 prompts, 64 and 256 generated tokens: peak blocks shared by the forked beams against each beam holding a
  full private copy, and the saving beside the PagedAttention paper's 37.6-55.2%.

    .venv/bin/python -m benchmarks.kv_memory            # 1,000 requests -> results/kv_memory.json + kv_memory.png
    .venv/bin/python -m benchmarks.kv_memory --smoke    # a second; writes nothing unless --out is given
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import logging
import random
import statistics
import time
from pathlib import Path

from radix.blocks import cdiv
from radix.manager import KVCacheManager

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results" / "kv_memory.json"
VOCAB = 49152


class ContiguousAllocator:
    """First-fit allocator of `reserve` contiguous slots per sequence over [0, capacity) slots (pre-paging design).

    Holes are kept sorted by start; allocate/free are O(holes).
    """

    def __init__(self, capacity: int, reserve: int) -> None:
        self.capacity, self.reserve = capacity, reserve
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
        start, length = self.owned.pop(seq_id), self.reserve
        i = bisect.bisect(self.holes, (start, 0))
        if i < len(self.holes) and start + length == self.holes[i][0]:
            length += self.holes.pop(i)[1]
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == start:
            start, length = self.holes[i - 1][0], self.holes[i - 1][1] + length
            self.holes[i - 1] = (start, length)
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


def _tokens(i: int, n: int) -> list[int]:
    return [(i * 7919 + j * 31) % VOCAB for j in range(n)]


def static_replay(
    requests: list[tuple[int, int]], num_blocks: int, block_size: int, max_len: int, trials: int = 50, seed: int = 0
) -> dict:
    """The design notes' arithmetic: admit requests at their final length, in order, until one does not fit; the mean
    over `trials` shuffled orders of the requests."""
    capacity, rng = num_blocks * block_size, random.Random(seed)
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
            if mgr.add_sequence(i, mgr.match_prefix(mgr.block_keys(_tokens(i, length)))) is None:
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
        self.requests, self.capacity = requests, capacity
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
        self.alloc, self.max_len = ContiguousAllocator(capacity, max_len), max_len

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
        if self.mgr.add_sequence(i, self.mgr.match_prefix(self.mgr.block_keys(_tokens(i, n)))) is None:
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
        self.mgr.append_tokens(i, _tokens(i, pos + 1)[pos:])
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


def parallel_sampling(n: int, prompt_len: int, gen_tokens: int, block_size: int) -> dict:
    """Blocks in use for n samples of one prompt: forked with copy-on-write (as the scheduler does) vs n full copies.

    Shared: add_sequence(prompt, prefill prompt[:-1]), commit, fork n children, free the parent; each child writes the
    last prompt token through prepare_write (a copy of the shared partial block for all but the last writer), then
    gen_tokens tokens. Full copies: n independent sequences of the same prompt.
    """
    prompt = _tokens(10**6, prompt_len)
    num_blocks = n * cdiv(prompt_len + gen_tokens, block_size)  # room for the full copies
    shared = KVCacheManager(num_blocks + 1, block_size, enable_prefix_caching=False)
    shared.add_sequence(0, shared.match_prefix(shared.block_keys(prompt)), num_new_tokens=prompt_len - 1)
    shared.commit_computed(0, prompt_len - 1)
    children = list(range(1, n + 1))
    for c in children:
        shared.fork(0, c)
    shared.free(0)
    copies = 0
    for c in children:
        shared.allocate(c, 1)
        copies += len(shared.prepare_write(c, prompt_len - 1, prompt_len))
        shared.commit_computed(c, prompt_len)
    after_prompt = shared.stats().in_use_blocks
    full = KVCacheManager(num_blocks + 1, block_size, enable_prefix_caching=False)
    for c in children:
        full.add_sequence(c, full.match_prefix(full.block_keys(prompt)))
        full.commit_computed(c, prompt_len)
    full_after_prompt = full.stats().in_use_blocks
    for mgr in (shared, full):
        for step in range(gen_tokens):
            for c in children:
                pos = prompt_len + step
                mgr.allocate(c, 1)
                pairs = mgr.prepare_write(c, pos, pos + 1)
                copies += len(pairs) if mgr is shared else 0
                mgr.append_tokens(c, [(c * 131 + step) % VOCAB])
                mgr.commit_computed(c, pos + 1)
        mgr.check_invariants()
    end, full_end = shared.stats().in_use_blocks, full.stats().in_use_blocks
    return {
        "n": n,
        "prompt_tokens": prompt_len,
        "generated_tokens_per_sample": gen_tokens,
        "cow_block_copies": copies,
        "after_prompt": {
            "shared_blocks": after_prompt,
            "full_copy_blocks": full_after_prompt,
            "saved_fraction": round(1 - after_prompt / full_after_prompt, 4),
        },
        "end_of_generation": {
            "shared_blocks": end,
            "full_copy_blocks": full_end,
            "saved_fraction": round(1 - end / full_end, 4),
        },
    }


def plot(result: dict, path: Path) -> None:
    """Bar chart: slot composition (dynamic), concurrency (static and dynamic), parallel-sampling blocks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dyn, static, par = result["dynamic"], result["static"], result["parallel_sampling"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = ["contiguous", "paged"]
    parts = [
        ("live", "tab:green"),
        ("reservation", "tab:orange"),
        ("internal", "tab:red"),
        ("external", "tab:purple"),
        ("free", "lightgray"),
    ]
    bottom = [0.0, 0.0]
    for part, color in parts:
        vals = [
            dyn[k]["live_fraction"]
            if part == "live"
            else dyn[k]["free_fraction"]
            if part == "free"
            else dyn[k]["waste_fraction"][part]
            for k in names
        ]
        axes[0].bar(names, vals, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    axes[0].set_ylabel("fraction of KV slots (steady state)")
    axes[0].legend(fontsize=8)
    slots = result["config"]["num_blocks"] * result["config"]["block_size"]
    axes[0].set_title(f"where the {slots:,} KV slots go")
    x = range(2)
    axes[1].bar([i - 0.2 for i in x], [static[k]["concurrent_sequences"] for k in names], 0.4, label="static")
    axes[1].bar([i + 0.2 for i in x], [dyn[k]["concurrent_sequences_mean"] for k in names], 0.4, label="dynamic")
    axes[1].set_xticks(list(x), names)
    axes[1].set_ylabel("concurrent sequences")
    axes[1].legend(fontsize=8)
    axes[1].set_title("sequences admitted")
    phases = ["after_prompt", "end_of_generation"]
    axes[2].bar([i - 0.2 for i in x], [par[p]["full_copy_blocks"] for p in phases], 0.4, label="full copies")
    axes[2].bar([i + 0.2 for i in x], [par[p]["shared_blocks"] for p in phases], 0.4, label="copy-on-write")
    axes[2].set_xticks(list(x), ["after prompt", "end of generation"])
    axes[2].set_ylabel("blocks in use")
    axes[2].legend(fontsize=8)
    axes[2].set_title(f"n={par['n']} samples, {par['prompt_tokens']}-token prompt")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(
    num_blocks: int,
    block_size: int,
    max_len: int,
    mean_len: int,
    requests: int,
    seed: int,
    gen_tokens: int,
    beam: dict | None = None,
) -> dict:
    """All the measurements (beam: beam_memory.run's model, widths, token counts and prompts; None: no beam rows);
    returns the JSON-ready result."""
    t0 = time.perf_counter()
    reqs = draw_requests(requests, mean_len, max_len, seed)
    contiguous = ContiguousSim(reqs, num_blocks * block_size, max_len)
    contiguous.run()
    paged = PagedSim(reqs, num_blocks, block_size)
    paged.run()
    paged.mgr.check_invariants()
    result = {
        "config": {
            "num_blocks": num_blocks,
            "block_size": block_size,
            "max_context": max_len,
            "mean_len_target": mean_len,
            "requests": requests,
            "seed": seed,
            "mean_len_drawn": round(statistics.mean(length for _, length in reqs), 1),
            "length_distribution": "final_len ~ Gamma(2) rescaled to the mean, clipped to [2, max_context]; "
            "prompt_len = final_len // 4",
        },
        "static": static_replay(reqs, num_blocks, block_size, max_len, seed=seed),
        "dynamic": {"contiguous": contiguous.summary(), "paged": paged.summary()},
        "parallel_sampling": parallel_sampling(4, 512, gen_tokens, block_size),
    }
    if beam is not None:
        from benchmarks import beam_memory

        result["beam_search"] = [
            beam_memory.run(beam["model"], beam["widths"], n, beam["prompts"], block_size) for n in beam["gen_tokens"]
        ]
    dyn = result["dynamic"]
    result["paged_vs_contiguous_concurrency"] = round(
        dyn["paged"]["concurrent_sequences_mean"] / dyn["contiguous"]["concurrent_sequences_mean"], 2
    )
    result["elapsed_s"] = round(time.perf_counter() - t0, 2)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=1000, help="usable KV blocks (the null block is extra)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--max-context", type=int, default=2048, help="tokens reserved per contiguous sequence")
    parser.add_argument("--mean-len", type=int, default=300, help="mean request length (tokens)")
    parser.add_argument("--requests", type=int, default=1000, help="requests of the dynamic replay")
    parser.add_argument("--gen-tokens", type=int, default=300, help="tokens per parallel sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--beam-model", default="smollm2", help="model of the beam search rows ('' for none)")
    parser.add_argument("--beam-tokens", default="64,256", help="generated tokens of the beam search rows")
    parser.add_argument("--quick", action="store_true", help="300 requests")
    parser.add_argument("--smoke", action="store_true", help="100 blocks, 40 requests; writes nothing by default")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {RESULTS}; none in --smoke)")
    ns = parser.parse_args(argv)
    if ns.quick:
        ns.requests = 300
    if ns.smoke:
        ns.num_blocks, ns.max_context, ns.requests, ns.gen_tokens = 100, 512, 40, 40
    beam = (
        {
            "model": ns.beam_model,
            "widths": [2, 4, 8],
            "prompts": 3,
            "gen_tokens": [int(n) for n in ns.beam_tokens.split(",")],
        }
        if ns.beam_model
        else None
    )
    if ns.smoke and beam is not None:
        beam.update(widths=[2], prompts=1, gen_tokens=[8])
    result = run(ns.num_blocks, ns.block_size, ns.max_context, ns.mean_len, ns.requests, ns.seed, ns.gen_tokens, beam)
    print(json.dumps(result, indent=1))
    path = ns.out if ns.out is not None else (None if ns.smoke else RESULTS)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        plot(result, path.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
