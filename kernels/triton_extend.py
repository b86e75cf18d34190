"""Triton extend/prefill attention over paged K/V: new query tokens on top of a cached prefix, varlen batch.

Program (query tile, seq, head) holds BLOCK_M query tokens of one head and walks the block table in BLOCK_N-token
tiles with the FlashAttention-2 online softmax (Dao 2023, Algorithm 1), under the causal mask
key_pos <= context_len - query_len + query_pos. It stops at the last key its last query can see, so a chunk late in a
long prompt does not read past its own position; with a sliding window W (key_pos > query_pos - W as well) it starts at
the first key its first query can see, so the blocks before the tile's windows are never read. Cache offsets are int64
(block id * block stride).
A decode sequence (query_len 1) in a mixed batch is one tile with one live row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_decode import LOG2E


# window: one compiled kernel for every window (Triton would make the value 1 a constant of its own build).
@triton.jit(do_not_specialize=["window"])
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
    scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < q_len
    d_mask = d < HEAD_DIM
    q_rows = (q_begin + m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = prefix + m
    # Keys up to the last live query's position; a tile past the sequence's queries reads nothing.
    hi = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)
    hi = tl.where(tile * BLOCK_M < q_len, hi, 0)
    # From the first key the tile's first query sees (0 without a window).
    lo = tl.where(window > 0, tl.maximum(prefix + tile * BLOCK_M - window + 1, 0), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr + (block * stride_kb + offset * stride_kt + kv_head * stride_kh)[:, None] + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        visible = visible & ((window == 0) | (pos[None, :] > q_pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
        # Under a window a row may see no key of a tile (its window starts later): m_new stays -inf, and the shift
        # by 0 instead keeps alpha and p at exp2(-inf) = 0, never exp2(-inf + inf) = NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + (block * stride_vb + offset * stride_vt + kv_head * stride_vh)[:, None] + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention for a varlen batch of any query lengths. Shapes as kernels.paged_attention.

    Args:
        max_query_len: longest query_len in the batch (tokens); sizes the grid.
        sliding_window: W tokens or None (kernels.paged_attention's rule).
    Returns:
        [num_tokens, num_heads, head_dim], dtype of q.
    """
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    block_d = triton.next_power_of_2(head_dim)
    block_n = 32 if block_d > 64 else 64  # wide heads: smaller tiles keep a program's K/V tile in shared memory
    block_m = block_n
    if max_query_len <= 16:
        block_m = 16  # decode-like steps: no rows of padding
    out = q.new_empty(q.shape)
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * LOG2E,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
