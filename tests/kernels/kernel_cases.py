"""Shared builders for the kernel tests: paged batches over shuffled blocks and a dense float64 oracle; random
group-quantized weights for the qgemv op.

Not a test module (pytest does not collect it); the reference tests and the Triton interpreter cases import it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kernels.cpu_qgemv import GROUP, Q4Weight, Q8Weight, pack_q4
from radix.blocks import cdiv

# Pairwise cover of GQA ratio x head_dim x block_size: every pair of values appears in some case (12 cases, not 24).
GQA_RATIOS = (1, 3, 4, 8)
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (8, 16, 32)
PAIRWISE = [
    (ratio, HEAD_DIMS[(ri + bi) % 2], bs)
    for (ri, ratio), (bi, bs) in itertools.product(enumerate(GQA_RATIOS), enumerate(BLOCK_SIZES))
]


def mixed_spec(block_size: int) -> list[tuple[int, int]]:
    """(cached_tokens, query_len) per sequence: decodes at, one over and one under a block multiple, a one-token
    sequence, an extend on a cached prefix, a fresh prefill and a one-token prefill."""
    bs = block_size
    return [
        (2 * bs - 1, 1),  # decode, seq_len an exact multiple of block_size
        (2 * bs, 1),  # one over
        (3 * bs - 2, 1),  # one under
        (0, 1),  # one-token sequence
        (2 * bs, bs + 3),  # extend over a cached prefix
        (0, 2 * bs - 1),  # fresh prefill
        (bs - 1, 2),  # extend ending exactly on a block boundary
    ]


def window_spec(block_size: int) -> list[tuple[int, int]]:
    """(cached_tokens, query_len) per sequence: decodes short and long, an extend whose window reaches back into
    its prefix, a fresh prefill longer than the windows, and a late chunk of a long prompt (its prefix mostly
    outside every window but the largest)."""
    bs = block_size
    decodes = [(0, 1), (bs - 1, 1), (2 * bs, 1), (5 * bs + 3, 1), (7 * bs - 1, 1)]
    return [*decodes, (2 * bs + 5, 9), (0, 3 * bs + 2), (6 * bs, bs + 1)]


def window_decode_spec(block_size: int) -> list[tuple[int, int]]:
    """(cached_tokens, 1) per sequence: decodes shorter and longer than the windows, at and around block multiples."""
    bs = block_size
    return [(n - 1, 1) for n in (1, bs - 1, bs, bs + 1, 3 * bs, 5 * bs + 7, 2, 8 * bs - 3)]


@dataclass
class PagedBatch:
    """A varlen batch over a paged cache, with each sequence's contiguous K/V kept for the oracle."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    k_dense: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    v_dense: list[torch.Tensor]
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc, self.scale)


def make_batch(
    spec: list[tuple[int, int]],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
    device: str = "cpu",
) -> PagedBatch:
    """Build a batch whose blocks are a shuffled (non-contiguous) set; unused blocks (block 0 included) hold large
    garbage so that a read outside a sequence's context shows in the output."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in spec]
    need = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = 1 + sum(need) + spare_blocks
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = 50 * torch.randn(shape, generator=gen)
    v_cache = 50 * torch.randn(shape, generator=gen)
    tables = torch.zeros(len(spec), max(need) + 1, dtype=torch.int32)
    k_dense, v_dense = [], []
    for i, seq_len in enumerate(seq_lens):
        blocks = [order.pop() for _ in range(need[i])]
        tables[i, : need[i]] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        for p in range(seq_len):
            k_cache[blocks[p // block_size], p % block_size] = k[p]
            v_cache[blocks[p // block_size], p % block_size] = v[p]
        k_dense.append(k.to(dtype))
        v_dense.append(v.to(dtype))
    q_lens = [n for _, n in spec]
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    return PagedBatch(
        q=put(q),
        k_cache=put(k_cache),
        v_cache=put(v_cache),
        block_tables=put(tables),
        seq_lens=put(torch.tensor(seq_lens, dtype=torch.int32)),
        query_start_loc=put(qsl),
        k_dense=k_dense,
        v_dense=v_dense,
        scale=head_dim**-0.5,
    )


def window_mask(q_pos: torch.Tensor, seq_len: int, sliding_window: int | None) -> torch.Tensor:
    """bool [len(q_pos), seq_len]: query at q_pos[i] may see key k. Causal; with a window W also k > q_pos[i] - W
    (transformers' sliding_window_overlay; test_sliding_window checks it against transformers' own function)."""
    keys = torch.arange(seq_len)[None, :]
    allowed = keys <= q_pos[:, None]
    if sliding_window:
        allowed &= keys > q_pos[:, None] - sliding_window
    return allowed


def dense_attention(batch: PagedBatch, sliding_window: int | None = None) -> torch.Tensor:
    """Oracle: float64 causal attention over each sequence's contiguous K/V, K/V repeated per query head; with a
    sliding window, the mask of window_mask."""
    q = batch.q.double().cpu()
    out = torch.empty_like(q)
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        s, e = starts[i], starts[i + 1]
        group = q.shape[1] // batch.k_dense[i].shape[1]
        k = batch.k_dense[i].double().repeat_interleave(group, dim=1)  # [L, H, d]
        v = batch.v_dense[i].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e], k) * batch.scale
        q_pos = torch.arange(seq_len - (e - s), seq_len)
        allowed = window_mask(q_pos, seq_len, sliding_window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def poison_before_window(batch: PagedBatch, sliding_window: int) -> int:
    """Fill with NaN every block that lies wholly before the window of its sequence's first query (never to be
    read: a read shows as NaN in the output, masked or not). Mutates the caches; returns the blocks poisoned."""
    block_size = batch.k_cache.shape[1]
    starts = batch.query_start_loc.tolist()
    poisoned = 0
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        first = max(0, seq_len - (starts[i + 1] - starts[i]) - sliding_window + 1)
        blocks = batch.block_tables[i, : first // block_size].long()
        batch.k_cache[blocks] = float("nan")
        batch.v_cache[blocks] = float("nan")
        poisoned += blocks.numel()
    return poisoned


def random_weight(bits: int, n: int, k: int, gen: torch.Generator) -> tuple[Q4Weight | Q8Weight, torch.Tensor]:
    """A random 4-bit or 8-bit weight and its codes (uint8 0..15 or int8 -127..127) [N, K]."""
    scales = torch.rand(n, k // GROUP, generator=gen) * 0.1
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        return Q4Weight(pack_q4(q), scales, torch.randn(n, k // GROUP, generator=gen) * 0.1), q
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return Q8Weight(q, scales), q
