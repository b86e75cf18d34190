"""Triton decode attention over paged K/V with split-KV (flash-decoding).

Pass 1 (`_decode_split_kernel`): program (seq, kv_head, split) reduces one slice of the sequence's context, for all
G = num_heads / num_kv_heads query heads of that KV head at once (so each K/V tile is read once for G heads), to a
partial output and its log-sum-exp. Pass 2 (`_decode_merge_kernel`) merges the slices with the online-softmax
rescaling: out = sum_s exp(lse_s - m) * o_s / sum_s exp(lse_s - m), m = max_s lse_s. With a sliding window W the
slices cover only the keys L - W .. L - 1 (kernels.paged_attention's rule), so blocks before the window are never read
and the split count follows the window, not the context.
Sources: Dao et al., "Flash-Decoding for long-context inference" (2023); Milakov & Gimelshein, "Online normalizer
calculation for softmax" (2018). Offsets into the caches are int64 (block id * block stride), so num_blocks up to
2^20 and contexts up to 128k tokens cannot overflow int32 arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


# window: one compiled kernel for every window (Triton would make the value 1 a constant of its own build).
@triton.jit(do_not_specialize=["window"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    tokens_per_split,
    num_splits,
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
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_ptr + seq).to(tl.int64)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # the first key the query sees
    start = lo + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr + (block * stride_kb + offset * stride_kt + kv_head * stride_kh)[:, None] + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + (block * stride_vb + offset * stride_vt + kv_head * stride_vh)[:, None] + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # An empty slice (start >= seq_len) leaves l_i = 0: its lse is -inf and the merge gives it weight 0.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        row = (seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], acc / l_safe[:, None], mask=out_mask)
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    query_start_ptr,
    out_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_ptr + seq).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits + sp
    lse = tl.load(part_lse_ptr + row, mask=sp < num_splits, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], mask=(sp < num_splits)[:, None], other=0.0)
    out = tl.sum(weight[:, None] * part, 0) / tl.sum(weight, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def choose_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, target_programs: int) -> int:
    """Number of context slices per sequence: enough programs to fill the device (target_programs), but no slice
    shorter than 4 tiles of block_n tokens, and at most 64 slices. Returns an int >= 1."""
    if max_seq_len <= 0:
        return 1
    want = triton.cdiv(target_programs, max(1, num_seqs * num_kv_heads))
    most = max(1, max_seq_len // (4 * block_n))
    return max(1, min(want, most, 64))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode attention (one query token per sequence) with split-KV. Shapes as kernels.paged_attention.

    Args:
        max_seq_len: longest seq_len in the batch (tokens); sizes the split.
        sliding_window: W tokens or None: each query reads keys L - W .. L - 1 only, and the split is sized from
            min(max_seq_len, W).
        num_splits: context slices per sequence (None: choose_splits for the device).
        block_n, num_warps, num_stages: launch configuration (tokens per K/V tile; None: 64); the benchmark's
            --sweep measures alternatives.
    Returns:
        [num_tokens, num_heads, head_dim], dtype of q. Allocates float32 partials of
        num_seqs * num_heads * num_splits * head_dim elements when num_splits > 1.
    """
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    block_n = block_n or 64
    span = min(max_seq_len, sliding_window) if sliding_window else max_seq_len  # keys one query reads at most
    if num_splits is None:
        target = 4 * torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        num_splits = choose_splits(num_seqs, num_kv_heads, span, block_n, target)
    tokens_per_split = triton.cdiv(max(span, 1), num_splits)
    tokens_per_split = triton.cdiv(tokens_per_split, block_n) * block_n
    out = q.new_empty(q.shape)
    direct = num_splits == 1
    part_rows = 0 if direct else num_seqs * num_heads * num_splits
    part_out = q.new_empty(part_rows * block_d, dtype=torch.float32)
    part_lse = q.new_empty(part_rows, dtype=torch.float32)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        tokens_per_split,
        num_splits,
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
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        DIRECT=direct,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not direct:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            query_start_loc,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return out
