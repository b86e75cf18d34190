"""Triton KV cache writes: store_kv (new tokens into their slots) and copy_blocks (copy-on-write).

Offsets are int64: slot * token stride and block id * block stride stay exact for num_blocks up to 2^20 and beyond.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # slot -1 is padding: the mask drops every lane, so nothing is read or written for it. A slot past the cache is
    # dropped too (the reference raises for it; checking here would cost a device sync).
    slots = tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot
    mask = (slots >= 0) & (slots < num_slots) & (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k = tl.load(k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kct + h[:, None] * stride_kch + d[None, :]
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vct + h[:, None] * stride_vch + d[None, :]
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


@triton.jit
def _copy_blocks_kernel(
    k_ptr,
    v_ptr,
    pairs_ptr,
    stride_layer,
    stride_block,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(pairs_ptr + 2 * pair)
    dst = tl.load(pairs_ptr + 2 * pair + 1)
    i = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = i < BLOCK_NUMEL
    src_off = layer * stride_layer + src * stride_block + i
    dst_off = layer * stride_layer + dst * stride_block + i
    tl.store(k_ptr + dst_off, tl.load(k_ptr + src_off, mask=mask), mask=mask)
    tl.store(v_ptr + dst_off, tl.load(v_ptr + src_off, mask=mask), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [num_tokens, kv_heads, head_dim] into slot_mapping's slots (int64; -1 and slots past the cache are
    skipped). Mutates the caches."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_cache.shape[0] * k_cache.shape[1],
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy blocks pairs[:, 0] -> pairs[:, 1] (int64 [n, 2] on the caches' device) along dim -4 of contiguous caches
    [..., num_blocks, block_size, kv_heads, head_dim]. The caller guarantees no dst is also a src (so the parallel
    copies cannot read a block another program writes). Mutates both caches."""
    num_blocks = k_cache.shape[-4]
    block_numel = math.prod(k_cache.shape[-3:])
    layers = k_cache.numel() // (num_blocks * block_numel)
    chunk = min(4096, triton.next_power_of_2(block_numel))
    grid = (pairs.shape[0], layers, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        k_cache, v_cache, pairs, num_blocks * block_numel, block_numel, BLOCK_NUMEL=block_numel, CHUNK=chunk
    )
