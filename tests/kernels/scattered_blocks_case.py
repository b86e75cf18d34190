"""The body of case C10 of shared/cases/prefix-cache-cases.md: scattered blocks, exact slots, no stray writes.

block_size 4. A = [1..8] is cached in blocks b5, b2. B = [1..14] reuses b5, b2 and gets two new blocks from a shuffled
free list, then decodes and takes a multi-token step that opens a fifth block. At every step: only the slots
block_table[p // bs] * bs + p % bs of this step's positions change, and attention equals dense attention over a
contiguous copy of the sequence's K/V.
"""

from __future__ import annotations

import torch

import kernels

BS, KV_HEADS, GROUP, HEAD_DIM, NUM_BLOCKS = 4, 1, 3, 64, 12


def _step(k_cache, v_cache, k_all, v_all, table: list[int], start: int, end: int, backend: str) -> None:
    """Store positions [start, end) of one sequence, check the written slots, check attention for those queries."""
    positions = torch.arange(start, end)
    table_t = torch.tensor(table, dtype=torch.int64)
    slots = table_t[positions // BS] * BS + positions % BS
    k_before, v_before = k_cache.clone(), v_cache.clone()
    kernels.store_kv(k_all[start:end], v_all[start:end], k_cache, v_cache, slots, backend=backend)

    changed = ((k_cache != k_before).flatten(2).any(-1) | (v_cache != v_before).flatten(2).any(-1)).flatten()
    assert changed.nonzero().flatten().tolist() == sorted(slots.tolist())

    gen = torch.Generator().manual_seed(end)
    q = torch.randn(end - start, KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    block_tables = torch.tensor([table + [0] * 2], dtype=torch.int32)
    out = kernels.paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        torch.tensor([end], dtype=torch.int32),
        torch.tensor([0, end - start], dtype=torch.int32),
        HEAD_DIM**-0.5,
        backend=backend,
    )
    k = k_all[:end].double().repeat_interleave(GROUP, dim=1)
    v = v_all[:end].double().repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * HEAD_DIM**-0.5
    allowed = torch.arange(end)[None, :] <= positions[:, None]
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def run_c10(backend: str) -> None:
    """Run case C10 on ``backend`` (also used by the Triton interpreter cases)."""
    gen = torch.Generator().manual_seed(10)
    k_cache = torch.randn(NUM_BLOCKS, BS, KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(NUM_BLOCKS, BS, KV_HEADS, HEAD_DIM, generator=gen)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    for b in (5, 2):
        free.remove(b)
    k_b = torch.randn(17, KV_HEADS, HEAD_DIM, generator=gen)  # B's K/V; A's tokens are B's first 8
    v_b = torch.randn(17, KV_HEADS, HEAD_DIM, generator=gen)

    _step(k_cache, v_cache, k_b, v_b, [5, 2], 0, 8, backend)  # A's prefill fills b5, b2
    table_b = [5, 2, free.pop(), free.pop()]
    _step(k_cache, v_cache, k_b, v_b, table_b, 8, 14, backend)  # B extends on the cached prefix
    _step(k_cache, v_cache, k_b, v_b, table_b, 14, 15, backend)  # decode
    table_b.append(free.pop())
    _step(k_cache, v_cache, k_b, v_b, table_b, 15, 17, backend)  # multi-token step into a fifth block
