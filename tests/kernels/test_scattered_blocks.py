"""Case C10 of shared/cases/prefix-cache-cases.md: scattered blocks, exact slots, no stray writes.

block_size 4. A = [1..8] is cached in blocks b5, b2. B = [1..14] reuses b5, b2 and gets two new blocks from a shuffled
free list, then decodes and takes a multi-token step that opens a fifth block. At every step: only the slots
block_table[p // bs] * bs + p % bs of this step's positions change, and attention equals dense attention over a
contiguous copy of the sequence's K/V.
"""

from __future__ import annotations

from tests.kernels.scattered_blocks_case import run_c10


def test_c10_scattered_blocks_reference() -> None:
    run_c10("reference")
