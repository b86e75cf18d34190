"""Sliding-window decode rows of benchmarks/attention_kernel.py (CPU): a windowed decode over a long context against
the full-context decode of the same batch, per backend (the fused operator and gather + SDPA) and dtype.

Each row gives the seconds per layer (median over rounds, layers walked as a model does so K/V come from memory),
the blocks a decode reads (blocks_read: per sequence, the blocks from the one holding key L - W to the last, the
kernels' rule, which tests/kernels/test_sliding_window.py checks by filling every other block with NaN) against the
context's blocks, and vs_full (windowed seconds / full seconds, same backend and dtype).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import kernels
from benchmarks.attention_kernel_cpu import BLOCK_SIZE, HEADS, Stack, timed, without_fused
from radix.blocks import cdiv

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
