"""The CPU decode kernel before and after its query heads of a KV group shared each K/V row (kernels/cpu_decode.cpp's
attend_tile), side by side in one process: us per call, and the largest difference between their outputs.

"base" is the kernel at benchmarks/cpu_decode_variant.BASE_COMMIT (one query row at a time; read from git history),
built under its own operator name (`--base tree`: this checkout's kernel again, a self-comparison for the smoke test
and for a checkout without history); "grouped" is this checkout's torch.ops.radixserve.paged_decode. Per shape,
`layers` distinct caches (one per layer, so that K/V come from memory as a model reads them, not from a cache level
one call warmed) are read in one pass; the two kernels alternate pass by pass (base first in even rounds, grouped
first in odd ones) and the median pass, over the layers, is the figure. On a shared VM whose speed drifts by 2x from
minute to minute, only this ratio means anything.

Shapes: SmolLM2-135M heads (9 q / 3 kv / 64) and gemma3-270m heads (4 q / 1 kv / 256), block 16, bfloat16 caches
(`--dtype float32`: float32 ones, written to results/attention_gqa_cpu_float32.json).

    .venv/bin/python -m benchmarks.attention_gqa_cpu            # 1 thread, 30 layers, 41 rounds a shape
    .venv/bin/python -m benchmarks.attention_gqa_cpu --smoke    # seconds; writes nothing unless --out
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.cli import write_result
from benchmarks.cpu_decode_variant import BASE_COMMIT, git_source, load_variant, tree_source
from kernels import cpu_decode
from radix.blocks import cdiv

RESULTS = Path(__file__).parent / "results"
BLOCK_SIZE = 16
HEADS = {"smollm2": (9, 3, 64), "gemma3-270m": (4, 1, 256)}  # query heads, kv heads, head_dim
# (heads, batch, context) of a full run; a smoke run takes the first two at batch 2, context 40
SHAPES = [
    ("smollm2", 1, 560),
    ("smollm2", 1, 2048),
    ("smollm2", 8, 512),
    ("gemma3-270m", 1, 560),
    ("gemma3-270m", 1, 2048),
    ("gemma3-270m", 8, 512),
]
VARIANTS = ("base", "grouped")


class Caches:
    """`layers` paged bfloat16 K/V caches [blocks, BLOCK_SIZE, kvh, d], each sequence's blocks at shuffled places,
    and one decode query batch [batch, heads, d] over them (every sequence `context` tokens)."""

    def __init__(self, heads: tuple[int, int, int], batch: int, context: int, layers: int, dtype: torch.dtype) -> None:
        h, kvh, d = heads
        per_seq = cdiv(context, BLOCK_SIZE)
        num_blocks = batch * per_seq
        self.k = [torch.randn(num_blocks, BLOCK_SIZE, kvh, d).to(dtype) for _ in range(layers)]
        self.v = [torch.randn(num_blocks, BLOCK_SIZE, kvh, d).to(dtype) for _ in range(layers)]
        self.tables = torch.randperm(num_blocks).view(batch, per_seq).to(torch.int32)
        self.lens = torch.full((batch,), context, dtype=torch.int32)
        self.q = torch.randn(batch, h, d).to(dtype)
        self.scale = d**-0.5

    def call(self, op: Callable[..., torch.Tensor], layer: int) -> torch.Tensor:
        """op on layer `layer`'s caches (full attention)."""
        return op(self.q, self.k[layer], self.v[layer], self.tables, self.lens, self.scale, 0)


def time_passes(ops: dict[str, Callable[..., torch.Tensor]], caches: Caches, rounds: int) -> dict[str, float]:
    """Median seconds per call of each op over `rounds` passes over all layers, the ops alternating pass by pass
    (their order flipped every round), after one warm-up pass each."""
    names = list(ops)
    layers = len(caches.k)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        for layer in range(layers):
            caches.call(ops[name], layer)
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            for layer in range(layers):
                caches.call(ops[name], layer)
            samples[name].append((time.perf_counter() - start) / layers)
    return {name: statistics.median(s) for name, s in samples.items()}


def max_difference(ops: dict[str, Callable[..., torch.Tensor]], caches: Caches) -> float:
    """The largest |base - grouped| over every layer's output (0.0: the same bits, up to the sign of zero)."""
    diffs = [
        (caches.call(ops["base"], layer).float() - caches.call(ops["grouped"], layer).float()).abs().max().item()
        for layer in range(len(caches.k))
    ]
    return max(diffs)


def run(
    shapes: list[tuple[str, int, int]],
    layers: int,
    rounds: int,
    threads: int,
    dtype: torch.dtype = torch.bfloat16,
    base: str = "commit",
) -> dict[str, Any]:
    """Rows of us per call for each shape and variant; torch's thread count is set to `threads` for the run. base:
    "commit" (BASE_COMMIT's kernel, from git history: raises subprocess.CalledProcessError without it) or "tree"."""
    from runtime.model.cpu_features import machine_facts

    op = cpu_decode.load_op()
    if op is None:
        raise RuntimeError("the CPU decode kernel did not build (see the warning of kernels.cpu_decode)")
    source = git_source(BASE_COMMIT) if base == "commit" else tree_source()
    ops = {"base": load_variant(f"gqa_base_{base}", *source), "grouped": op}
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        for name, batch, context in shapes:
            caches = Caches(HEADS[name], batch, context, layers, dtype)
            t = time_passes(ops, caches, rounds)
            h, kvh, d = HEADS[name]
            rows.append(
                {
                    "heads": f"{name} {h}q/{kvh}kv/{d}",
                    "batch": batch,
                    "context": context,
                    "dtype": str(dtype).removeprefix("torch."),
                    **{f"{v}_us": round(t[v] * 1e6, 2) for v in VARIANTS},
                    "speedup": round(t["base"] / t["grouped"], 3),
                    "max_abs_difference": max_difference(ops, caches),
                }
            )
        machine = machine_facts()
    finally:
        torch.set_num_threads(saved)
    config = {"threads": threads, "layers": layers, "rounds": rounds}
    base_name = BASE_COMMIT if base == "commit" else "tree"
    return {"machine": machine, "base_commit": base_name, "config": config, "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="seconds: two small shapes, 2 layers, 3 rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the kernels (default 1)")
    parser.add_argument("--layers", type=int, default=30, help="distinct caches read per pass (default 30)")
    parser.add_argument("--rounds", type=int, default=41, help="passes per variant and shape (default 41)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="cache dtype")
    parser.add_argument("--base", choices=("commit", "tree"), default="commit", help="the base kernel's source")
    parser.add_argument("--out", type=Path, help="JSON output (default results/attention_gqa_cpu[_float32].json)")
    ns = parser.parse_args(argv)
    dtype = getattr(torch, ns.dtype)
    if ns.smoke:
        shapes = [(name, 2, 40) for name in HEADS]
        result = run(shapes, layers=2, rounds=3, threads=ns.threads, dtype=dtype, base=ns.base)
    else:
        result = run(SHAPES, ns.layers, ns.rounds, ns.threads, dtype, ns.base)
    suffix = "" if dtype == torch.bfloat16 else f"_{ns.dtype}"
    write_result(result, ns.out, ns.smoke, RESULTS / f"attention_gqa_cpu{suffix}.json")
    for row in result["rows"]:
        print(row)
    return result


if __name__ == "__main__":
    main()
