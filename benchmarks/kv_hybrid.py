"""Hybrid KV memory rows of benchmarks/kv_memory.py: KV bytes per sequence and concurrent sequences at a fixed memory,
all-full (every layer keeps its whole KV: radix.manager.KVCacheManager) against hybrid (the sliding-window layers
keep their window only: radix.hybrid_manager.HybridKVCacheManager), on Gemma 3 270M's real shapes.

Shapes (google/gemma-3-270m config.json, the embedded gemma3-270m's): 18 layers, 15 sliding with a 512-token window
and 3 global ("full_attention" every sixth), 1 KV head of head_dim 256, bfloat16 KV: 2 * 256 * 2 = 1,024 bytes per
token per layer. The issue's formula for the hybrid fraction of KV per sequence at context L: (3 + 15 * min(W, L) /
L) / 18 (22% at 8k); the managers' figure is a little above it, since a sequence keeps whole blocks
(cdiv(W, B) + 1 of the window layers' at most).

Each sequence is driven as the scheduler drives it: admitted with its first prefill chunk, then allocate + commit per
chunk of `chunk` tokens up to its context (the window group releases the blocks the window left behind at each
commit). Concurrency: pools sized from `memory` bytes (hybrid: window_blocks_ratio = the steady window blocks per full
block of a sequence at that context, what an operator would set, runtime/model/hybrid_kv.py), sequences admitted one
after another until one cannot get its blocks; the count is the real managers' answer, prefill transients included.

    .venv/bin/python -m benchmarks.kv_hybrid            # 1k / 4k / 8k, 2 GiB -> results/kv_memory_hybrid.json
    .venv/bin/python -m benchmarks.kv_hybrid --smoke    # 256 / 1k, 64 MiB; writes nothing unless --out is given
(benchmarks/kv_memory.py runs the same rows into its own JSON.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.cli import write_result
from radix.blocks import cdiv
from radix.hybrid_manager import HybridKVCacheManager
from radix.manager import KVCacheManager

LAYERS = 18
FULL_LAYERS = 3
WINDOW = 512
TOKEN_LAYER_BYTES = 2 * 1 * 256 * 2  # K and V, 1 KV head, head_dim 256, bfloat16
RESULTS = Path(__file__).parent / "results" / "kv_memory_hybrid.json"


def formula_fraction(context: int) -> float:
    """The issue's hybrid / all-full KV per sequence: (3 + 15 * min(W, L) / L) / 18."""
    return (FULL_LAYERS + (LAYERS - FULL_LAYERS) * min(WINDOW, context) / context) / LAYERS


def _fill(m: KVCacheManager, seq_id: int, context: int, chunk: int) -> bool:
    """Admit seq_id and compute `context` tokens in chunks; False (the sequence freed) when blocks run out."""
    tokens = [(seq_id * 7919 + j * 31) % 49152 + 3 for j in range(context)]
    if m.add_sequence(seq_id, m.match_prefix(m.block_keys(tokens)), num_new_tokens=min(chunk, context)) is None:
        return False
    done = min(chunk, context)
    m.commit_computed(seq_id, done)
    while done < context:
        n = min(chunk, context - done)
        if m.allocate(seq_id, n) is None:
            m.free(seq_id)
            return False
        done += n
        m.commit_computed(seq_id, done)
    return True


def _block_bytes(layers: int, block_size: int) -> int:
    return layers * block_size * TOKEN_LAYER_BYTES


def bytes_per_sequence(context: int, block_size: int, chunk: int) -> dict:
    """KV bytes one sequence holds at `context` tokens, all-full and hybrid (blocks in use in each pool)."""
    blocks = cdiv(context, block_size) + 1
    full = KVCacheManager(blocks + 1, block_size, enable_prefix_caching=False)
    assert _fill(full, 0, context, chunk)
    hybrid = HybridKVCacheManager(
        blocks + 1, block_size, num_window_blocks=blocks + 1, window=WINDOW, enable_prefix_caching=False
    )
    assert _fill(hybrid, 0, context, chunk)
    hybrid.check_invariants()
    all_full = full.stats().in_use_blocks * _block_bytes(LAYERS, block_size)
    window_blocks = hybrid.window_stats().in_use_blocks
    mixed = hybrid.stats().in_use_blocks * _block_bytes(FULL_LAYERS, block_size)
    mixed += window_blocks * _block_bytes(LAYERS - FULL_LAYERS, block_size)
    return {"all_full": all_full, "hybrid": mixed, "window_blocks": window_blocks}


def concurrent_sequences(memory: int, context: int, block_size: int, chunk: int) -> dict:
    """Sequences of `context` tokens that fit in `memory` bytes of KV, all-full and hybrid (real managers)."""
    full_bytes = _block_bytes(FULL_LAYERS, block_size)
    window_bytes = _block_bytes(LAYERS - FULL_LAYERS, block_size)
    full = KVCacheManager(memory // (full_bytes + window_bytes) + 1, block_size, enable_prefix_caching=False)
    ratio = min(1.0, (cdiv(min(WINDOW, context), block_size) + 1) / cdiv(context, block_size))
    num_blocks = int(memory // (full_bytes + ratio * window_bytes))
    num_window = int(ratio * num_blocks)
    hybrid = HybridKVCacheManager(
        num_blocks + 1, block_size, num_window_blocks=num_window + 1, window=WINDOW, enable_prefix_caching=False
    )
    counts = {}
    for name, m in (("all_full", full), ("hybrid", hybrid)):
        n = 0
        while _fill(m, n, context, chunk):
            n += 1
        m.check_invariants()
        counts[name] = n
    counts["window_blocks_ratio"] = round(ratio, 4)
    return counts


def hybrid_rows(contexts: list[int], memory: int, block_size: int, chunk: int) -> dict:
    """The JSON rows: per context, bytes per sequence and concurrent sequences, both ways, beside the formula."""
    rows = []
    for context in contexts:
        per_seq = bytes_per_sequence(context, block_size, chunk)
        conc = concurrent_sequences(memory, context, block_size, chunk)
        fraction = per_seq["hybrid"] / per_seq["all_full"]
        rows.append(
            {
                "context": context,
                "kv_bytes_per_seq": {"all_full": per_seq["all_full"], "hybrid": per_seq["hybrid"]},
                "window_blocks_per_seq": per_seq["window_blocks"],
                "hybrid_fraction": round(fraction, 4),
                "formula_fraction": round(formula_fraction(context), 4),
                "fraction_vs_formula": round(fraction / formula_fraction(context), 4),
                "concurrent_sequences": {"all_full": conc["all_full"], "hybrid": conc["hybrid"]},
                "concurrency_gain": round(conc["hybrid"] / max(1, conc["all_full"]), 2),
                "window_blocks_ratio": conc["window_blocks_ratio"],
            }
        )
    return {
        "model_shapes": "gemma3-270m: 18 layers (15 sliding, window 512; 3 full), 1 KV head x 256, bfloat16",
        "memory_bytes": memory,
        "block_size": block_size,
        "prefill_chunk": chunk,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,4096,8192", help="sequence contexts (tokens)")
    parser.add_argument("--memory", type=int, default=2 * 2**30, help="KV bytes of the concurrency rows")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument("--smoke", action="store_true", help="256 / 1k tokens, 64 MiB; writes nothing by default")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {RESULTS}; none in --smoke)")
    ns = parser.parse_args(argv)
    if ns.smoke:
        ns.contexts = "256,1024"
        ns.memory = 64 * 2**20
    from runtime.model.cpu_features import machine_facts

    contexts = [int(n) for n in ns.contexts.split(",")]
    result = hybrid_rows(contexts, ns.memory, ns.block_size, ns.chunk)
    result["machine"] = machine_facts()
    print(json.dumps(result, indent=1))
    write_result(result, ns.out, ns.smoke, RESULTS)
    return result


if __name__ == "__main__":
    main()
