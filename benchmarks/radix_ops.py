"""Radix-tree operation cost versus tree size: per-block match / insert / evict times must not grow with the tree.

Trace: `conversations` chats x `turns` turns sharing a 512-token system prompt; each turn's prompt is the whole
conversation so far plus 128 new user tokens, and the turn generates 128 tokens (block_size 16). Each turn drives the
manager exactly as runtime/scheduler/scheduler.py does (one request, one sequence): block_keys once, match_prefix
(timed: match), add_sequence with that match (lock + allocate, no second match; timed: add), commit_computed of the
prompt and, after append_tokens and allocate for the generated tokens, of the whole sequence (timed: insert / commit),
free (timed: free).
The trace runs against a KVCacheManager whose tree is pre-filled with 10^4, 10^5 and 10^6 idle cached blocks (chains
of 64 blocks); each repeat uses its own cache_salt, so every repeat is cold for the trace while the pool holds the
whole trace. After each repeat, tree.evict of a batch of blocks is timed (evict: the pre-filled LRU leaves go).
Times are CPU time of this process (time.process_time), with the garbage collector paused while timing (as timeit
does), so other jobs on a shared machine and collection passes over the whole heap do not count.

Reported (benchmarks/results/radix_ops.json): tree_blocks; us_per_block[op][i] = median over repeats of (time of op)
/ (blocks it touched) at tree_blocks[i]; us_per_call[op][i] = median over repeats of the mean microseconds of one
call (keys, match, add, commit, free; evict: one tree.evict call of evict_blocks blocks); growth_ratio = max over
ops of (largest / smallest per-block time across sizes); hit_rate (cached prompt tokens / prompt tokens, one repeat)
and oracle_hit_rate (the trace's reusable fraction, computed by brute force without radix/); bytes_per_cached_block
(tracemalloc: whole manager, pre-filled).
Targets: growth_ratio <= 1.5, hit_rate == oracle_hit_rate, bytes_per_cached_block <= 640.

    .venv/bin/python -m benchmarks.radix_ops            # full: 5 repeats of 64 x 8 turns per size
    .venv/bin/python -m benchmarks.radix_ops --quick    # < 60 s on 2 cores: 3 repeats of 16 x 8 turns per size
    .venv/bin/python -m benchmarks.radix_ops --smoke    # seconds; small sizes; writes nothing unless --out is given

`run_trace(trace, page_size, pool_tokens)` replays a trace of chat turns (steps with .prompt and .output token lists,
as ../shared/peers/radix/mt_trace.py makes) the same way against a pool of pool_tokens tokens, for the peer harness
(side_by_side.py --extra benchmarks.radix_ops:run_trace). This module imports only radix/ and the standard library at
module level, so the harness can import it from its own virtualenv.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
import tracemalloc
from array import array
from pathlib import Path

from benchmarks.cli import output_path, run_mode
from radix.blocks import cdiv
from radix.events import BlockRemoved
from radix.keys import pack_blocks
from radix.manager import KVCacheManager

BLOCK_SIZE = 16
SYSTEM_TOKENS = 512
USER_TOKENS = 128
GEN_TOKENS = 128
CHAIN_BLOCKS = 64
VOCAB = 32000
RESULTS = Path(__file__).parent / "results" / "radix_ops.json"
CALL_OPS = ("keys", "match", "add", "commit", "free", "evict")


def make_trace(conversations: int, turns: int, seed: int = 0) -> list[list[tuple[list[int], list[int]]]]:
    """Per conversation, per turn: (prompt token ids, generated token ids)."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(SYSTEM_TOKENS)]
    trace = []
    for _ in range(conversations):
        history = list(system)
        chat = []
        for _ in range(turns):
            prompt = history + [rng.randrange(VOCAB) for _ in range(USER_TOKENS)]
            generated = [rng.randrange(VOCAB) for _ in range(GEN_TOKENS)]
            chat.append((prompt, generated))
            history = prompt + generated
        trace.append(chat)
    return trace


def oracle_hit_rate(trace: list[list[tuple[list[int], list[int]]]]) -> float:
    """Reusable fraction of prompt tokens: longest block-aligned prefix (capped at len - 1) seen before, by brute
    force over chained prefix ids built from Python tuples (no radix/ code)."""
    seen: set[int] = set()
    hits = queries = 0
    for chat in trace:
        for prompt, generated in chat:
            queries += len(prompt)
            prefix_id, reusable = 0, 0
            for i in range((len(prompt) - 1) // BLOCK_SIZE):
                prefix_id = hash((prefix_id, tuple(prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])))
                if prefix_id not in seen:
                    break
                reusable += BLOCK_SIZE
            hits += reusable
            full = prompt + generated
            prefix_id = 0
            for i in range(len(full) // BLOCK_SIZE):
                prefix_id = hash((prefix_id, tuple(full[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])))
                seen.add(prefix_id)
    return hits / queries


def trace_blocks(trace: list[list[tuple[list[int], list[int]]]]) -> int:
    """Blocks the trace can occupy at most (every turn's blocks, no sharing)."""
    return sum(cdiv(len(p) + len(g), BLOCK_SIZE) for chat in trace for p, g in chat)


def prefill(m: KVCacheManager, num_blocks: int, seed: int = 1) -> None:
    """Fill the tree with num_blocks idle cached blocks: chains of CHAIN_BLOCKS random blocks, inserted and released
    like finished requests."""
    rng = random.Random(seed)
    tree, pool = m.tree, m._pool
    left = num_blocks
    while left:
        n = min(CHAIN_BLOCKS, left)
        tokens = array("H", rng.randbytes(2 * n * BLOCK_SIZE)).tolist()  # random ids in [0, 65536)
        blocks = pool.allocate(n)
        assert len(tree.insert_chain(None, None, pack_blocks(tokens, BLOCK_SIZE), blocks).resident) == n
        tree.unlock(blocks)
        left -= n
    m.drain_events()


def replay(m: KVCacheManager, trace, salt: str, timings: dict[str, list[float]], counts: dict[str, int]) -> None:
    """One pass of the trace, driven as the scheduler drives the manager; adds seconds per call to timings[op] and
    touched blocks per op to counts (match: blocks walked, insert: blocks entering the tree)."""
    clock = time.process_time  # CPU time of this process: other jobs on a shared machine do not count
    seq_id = 0
    for chat in trace:
        for prompt, generated in chat:
            t0 = clock()
            keys = m.block_keys(prompt, salt)  # add_request
            t1 = clock()
            match = m.match_prefix(keys)  # _admit
            t2 = clock()
            cached = m.add_sequence(seq_id, match)
            t3 = clock()
            timings["keys"].append(t1 - t0)
            timings["match"].append(t2 - t1)
            timings["add"].append(t3 - t2)
            counts["match"] += min(len(match.block_ids) + 1, (len(prompt) - 1) // BLOCK_SIZE)
            assert cached == match.num_tokens, "the pool must hold the whole trace"
            before = m.tree.num_cached
            t0 = clock()
            m.commit_computed(seq_id, len(prompt))
            timings["commit"].append(clock() - t0)
            m.append_tokens(seq_id, generated)
            assert m.allocate(seq_id, len(generated)) is not None
            t0 = clock()
            m.commit_computed(seq_id, len(prompt) + len(generated))
            t1 = clock()
            m.free(seq_id)
            timings["free"].append(clock() - t1)
            timings["commit"].append(t1 - t0)
            counts["insert"] += m.tree.num_cached - before
            seq_id += 1
    m.drain_events()


def run_trace(trace, page_size: int = 16, pool_tokens: int = 200_000) -> dict:
    """Replay chat turns against a KVCacheManager of pool_tokens // page_size usable blocks (the peers' pool size;
    block 0, the null block, comes on top), as the scheduler drives it: per step block_keys, match_prefix,
    add_sequence(that match), commit_computed(prompt), append_tokens(output), allocate(output),
    commit_computed(prompt + output), free, drain_events (BlockRemoved counts evicted tokens).

    Returns wall_s (the whole loop, perf_counter), hit_tokens, prompt_tokens, hit_rate, evicted_tokens,
    per_step_hits_checksum = sum(i * hit_i), and *_us: mean microseconds per call of each operation (evictions run
    inside add_sequence and allocate). Raises MemoryError when a step does not fit the pool.
    """
    bs = page_size
    m = KVCacheManager(pool_tokens // bs + 1, bs, record_events=True)  # BlockRemoved events count evictions
    ops = ("keys", "match", "add", "commit_prompt", "append", "allocate", "commit_full", "free", "drain")
    spent = dict.fromkeys(ops, 0.0)
    hit_tokens = prompt_tokens = evicted_blocks = checksum = 0
    gc.collect()
    pc = time.perf_counter
    start = pc()
    for step_id, step in enumerate(trace):
        prompt, output = step.prompt, step.output
        prompt_tokens += len(prompt)
        t0 = pc()
        keys = m.block_keys(prompt)
        t1 = pc()
        match = m.match_prefix(keys)
        t2 = pc()
        hit = m.add_sequence(step_id, match)
        t3 = pc()
        if hit is None:
            raise MemoryError(f"add_sequence failed at step {step_id}")
        m.commit_computed(step_id, len(prompt))
        t4 = pc()
        m.append_tokens(step_id, output)
        t5 = pc()
        if m.allocate(step_id, len(output)) is None:
            raise MemoryError(f"allocate failed at step {step_id}")
        t6 = pc()
        m.commit_computed(step_id, len(prompt) + len(output))
        t7 = pc()
        m.free(step_id)
        t8 = pc()
        for event in m.drain_events():
            if type(event) is BlockRemoved:
                evicted_blocks += len(event.block_hashes)
        t9 = pc()
        for op, a, b in zip(
            ops, (t0, t1, t2, t3, t4, t5, t6, t7, t8), (t1, t2, t3, t4, t5, t6, t7, t8, t9), strict=True
        ):
            spent[op] += b - a
        hit_tokens += hit
        checksum += step_id * hit
    wall = pc() - start
    stats = m.stats()
    assert stats.num_sequences == 0 and stats.in_use_blocks == 0, stats
    n = max(1, len(trace))
    return {
        "impl": "radixserve.KVCacheManager (benchmarks.radix_ops.run_trace)",
        "page_size": bs,
        "pool_tokens": (m.num_blocks - 1) * bs,
        "steps": len(trace),
        "wall_s": wall,
        "hit_tokens": hit_tokens,
        "prompt_tokens": prompt_tokens,
        "hit_rate": hit_tokens / max(1, prompt_tokens),
        "evicted_tokens": evicted_blocks * bs,
        "per_step_hits_checksum": checksum,
        "cached_blocks_at_end": stats.cached_blocks,
        **{f"{op}_us": round(1e6 * t / n, 3) for op, t in spent.items()},
    }


def run_size(tree_blocks: int, trace, repeats: int, evict_blocks: int) -> dict[str, float]:
    """Median per-block microseconds of each op over repeats, for a tree pre-filled with tree_blocks blocks."""
    extra = trace_blocks(trace) * repeats
    m = KVCacheManager(tree_blocks + extra + evict_blocks + 1, BLOCK_SIZE)
    prefill(m, tree_blocks)
    per_rep: dict[str, list[float]] = {"match": [], "insert": [], "evict": []}
    per_call: dict[str, list[float]] = {op: [] for op in CALL_OPS}
    hit = None
    for r in range(repeats):
        gc.collect()
        gc.disable()  # as timeit does: a collection pass is not the cost of the operation being measured
        timings: dict[str, list[float]] = {op: [] for op in CALL_OPS if op != "evict"}
        counts = {"match": 0, "insert": 0}
        q0, h0 = m.stats().prefix_queries_tokens, m.stats().prefix_hits_tokens
        replay(m, trace, f"repeat-{r}", timings, counts)
        s = m.stats()
        hit = (s.prefix_hits_tokens - h0) / (s.prefix_queries_tokens - q0)
        per_rep["match"].append(sum(timings["match"]) / counts["match"] * 1e6)
        per_rep["insert"].append(sum(timings["commit"]) / counts["insert"] * 1e6)
        for op, seconds in timings.items():
            per_call[op].append(sum(seconds) / len(seconds) * 1e6)
        t0 = time.process_time()
        freed = m.tree.evict(evict_blocks)
        t1 = time.process_time()
        per_rep["evict"].append((t1 - t0) / len(freed) * 1e6)
        per_call["evict"].append((t1 - t0) * 1e6)
        gc.enable()
        m.drain_events()
        prefill(m, len(freed), seed=100 + r)  # back to tree_blocks pre-filled blocks
    result = {op: statistics.median(v) for op, v in per_rep.items()}
    result.update({f"call_{op}": statistics.median(v) for op, v in per_call.items()})
    result["hit_rate"] = hit
    return result


def bytes_per_cached_block(num_blocks: int) -> float:
    """tracemalloc bytes of a whole KVCacheManager (pool, tree, LRU, index) per cached block, pre-filled."""
    gc.collect()
    tracemalloc.start()
    start, _ = tracemalloc.get_traced_memory()
    m = KVCacheManager(num_blocks + 1, BLOCK_SIZE)
    prefill(m, num_blocks)
    gc.collect()
    end, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert m.stats().cached_blocks == num_blocks
    return (end - start) / num_blocks


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer conversations and repeats (< 60 s on 2 cores)")
    mode.add_argument("--smoke", action="store_true", help="seconds-long run of every code path; writes no file")
    ap.add_argument("--out", type=Path, default=None, help=f"JSON output (default {RESULTS}; none for --smoke)")
    args = ap.parse_args(argv)
    if args.smoke:
        sizes, conversations, turns, repeats, evict, mem_blocks = [1_000, 4_000], 4, 3, 2, 64, 2_000
    elif args.quick:
        sizes, conversations, turns, repeats, evict, mem_blocks = [10**4, 10**5, 10**6], 16, 8, 3, 1024, 20_000
    else:
        sizes, conversations, turns, repeats, evict, mem_blocks = [10**4, 10**5, 10**6], 64, 8, 5, 2048, 100_000
    t_start = time.perf_counter()
    trace = make_trace(conversations, turns)
    per_size = [run_size(n, trace, repeats, evict) for n in sizes]
    us = {op: [round(r[op], 4) for r in per_size] for op in ("match", "insert", "evict")}
    us_call = {op: [round(r[f"call_{op}"], 2) for r in per_size] for op in CALL_OPS}
    growth = max(max(v) / min(v) for v in us.values())
    result = {
        "tree_blocks": sizes,
        "us_per_block": us,
        "us_per_call": us_call,
        "growth_ratio": round(growth, 4),
        "hit_rate": per_size[-1]["hit_rate"],
        "oracle_hit_rate": oracle_hit_rate(trace),
        "bytes_per_cached_block": round(bytes_per_cached_block(mem_blocks), 1),
        "config": {
            "mode": run_mode(args.smoke, args.quick),
            "conversations": conversations,
            "turns": turns,
            "repeats": repeats,
            "evict_blocks": evict,
            "block_size": BLOCK_SIZE,
            "memory_tree_blocks": mem_blocks,
        },
        "targets": {"growth_ratio": 1.5, "bytes_per_cached_block": 640, "hit_rate": "== oracle_hit_rate"},
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    out = output_path(args.out, args.smoke, RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
