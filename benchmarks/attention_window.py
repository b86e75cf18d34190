"""Sliding-window paged decode on CPU: a windowed decode over a long context against the full-context decode of the
same batch, per backend (the fused operator and gather + SDPA, as in benchmarks/attention_kernel_cpu.py) and dtype,
SmolLM2 heads (9 q / 3 kv / 64), block 16.

Each row gives the seconds per layer (median over rounds, layers walked as a model does so K/V come from memory),
the blocks a decode reads (blocks_read: per sequence, the blocks from the one holding key L - W to the last, the
kernels' rule, which tests/kernels/test_sliding_window.py checks by filling every other block with NaN) against the
context's blocks, and vs_full (windowed seconds / full seconds, same backend and dtype). Machine facts in "device".

    .venv/bin/python -m benchmarks.attention_window            # -> benchmarks/results/attention_window.json
    .venv/bin/python -m benchmarks.attention_window --quick    # about a minute
    .venv/bin/python -m benchmarks.attention_window --smoke    # seconds; writes nothing unless --out is given
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

import kernels
from benchmarks.attention_kernel_cpu import BLOCK_SIZE, HEADS, Stack, timed, without_fused
from benchmarks.cli import output_path, run_mode
from radix.blocks import cdiv

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results" / "attention_window.json"

SHAPES = {  # mode -> (batch, context, windows): Gemma 3's local layers use 512 (270M) to 1024, Mistral 4096
    "smoke": [(2, 256, (32,))],
    "quick": [(8, 8192, (512,))],
    "full": [(1, 32768, (512, 4096)), (8, 8192, (512, 4096))],
}


def blocks_read(context: int, window: int | None) -> int:
    """Blocks one decode of a `context`-token sequence reads: all of them, or those from key context - W onwards."""
    first = 0 if window is None else max(0, context - window)
    return cdiv(context, BLOCK_SIZE) - first // BLOCK_SIZE


def _rows_for(batch: int, context: int, windows: tuple[int, ...], dtype: torch.dtype, rounds: int) -> list[dict]:
    _, kvh, d = HEADS
    nbytes = 2 * batch * context * kvh * d * torch.finfo(dtype).bits // 8
    layers = max(2, min(8, (512 << 20) // nbytes))
    stack = Stack(batch, context, dtype, layers)

    def decode(window: int | None) -> Callable[[], None]:
        def run() -> None:
            for layer in range(layers):
                kernels.paged_attention(
                    stack.q,
                    stack.k[layer],
                    stack.v[layer],
                    stack.tables,
                    stack.lens,
                    stack.qsl,
                    stack.scale,
                    1,
                    context,
                    sliding_window=window,
                )

        return run

    fns: dict[str, Callable[[], object]] = {}
    for window in (None, *windows):
        fns[f"fused|{window}"] = decode(window)
        fns[f"gather+sdpa|{window}"] = without_fused(decode(window))
    t = timed(fns, rounds)
    rows = []
    for key, (wall, cpu) in t.items():
        backend, window_text = key.split("|")
        window = None if window_text == "None" else int(window_text)
        rows.append(
            {
                "backend": backend,
                "dtype": str(dtype).removeprefix("torch."),
                "batch": batch,
                "context": context,
                "window": window,
                "blocks_read": batch * blocks_read(context, window),
                "blocks_in_context": batch * cdiv(context, BLOCK_SIZE),
                "seconds": wall / layers,
                "cpu_seconds": cpu / layers,
                "vs_full": round(wall / t[f"{backend}|None"][0], 3),
            }
        )
    return rows


def window_rows(mode: str) -> list[dict]:
    """The windowed and full decode rows of a mode ("smoke", "quick", "full"), float32 and bfloat16."""
    rounds = {"smoke": 1, "quick": 5, "full": 9}[mode]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for batch, context, windows in SHAPES[mode]:
            rows += _rows_for(batch, context, windows, dtype, rounds)
    return rows


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the result dict and writes it to --out (default results/ unless --smoke)."""
    from runtime.model.cpu_features import machine_facts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one shape (about a minute)")
    parser.add_argument("--smoke", action="store_true", help="seconds-long run; writes only with --out")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: figures least hurt by load)")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON path (default {RESULTS})")
    args = parser.parse_args(argv)
    mode = run_mode(args.smoke, args.quick)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    rows = window_rows(mode)
    result = {"device": {"type": "cpu", **machine_facts()}, "mode": mode, "block_size": BLOCK_SIZE, "rows": rows}
    out = output_path(args.out, args.smoke, RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for r in main()["rows"]:
        logger.info(
            "%-12s %-9s batch %4d ctx %6d window %5s  %6d of %6d blocks  %9.3f ms  %5.3fx full",
            r["backend"],
            r["dtype"],
            r["batch"],
            r["context"],
            r["window"],
            r["blocks_read"],
            r["blocks_in_context"],
            r["seconds"] * 1e3,
            r["vs_full"],
        )
