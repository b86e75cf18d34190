"""Triton kernels on a CUDA device against the reference (bf16 and fp32), run by benchmarks/gpu_check.sh.

Not collected by `make test` (no test_ prefix): it needs a GPU. The reference runs on float32 copies on the same
device, so it is an accurate oracle for the bf16 kernels. Includes block ids near 2^20 in a 2^20 + 8-block cache
(block id * block stride > 2^31 elements) and a 128k-token context, which overflow int32 offsets if any are left.
"""

from __future__ import annotations

import os

import pytest
import torch

import kernels
from kernels.triton_decode import decode_attention
from radix.blocks import cdiv
from tests.kernels.kernel_cases import (
    PAIRWISE,
    dense_attention,
    make_batch,
    mixed_spec,
    poison_before_window,
    window_decode_spec,
    window_spec,
)

# Overridable only to dry-run this file's logic on a CPU under TRITON_INTERPRET=1 with small sizes.
DEVICE = os.environ.get("KERNELS_TEST_DEVICE", "cuda")
BIG_NUM_BLOCKS = int(os.environ.get("KERNELS_TEST_BIG_NUM_BLOCKS", 2**20 + 8))
LONG_CONTEXT = int(os.environ.get("KERNELS_TEST_LONG_CONTEXT", 131072))
# The Triton 3.9 interpreter multiplies bf16 tl.dot operands as raw bits, so a CPU dry run needs float32. The
# sliding-window cases use it too (bf16 is what the interpreter cases cannot check).
BIG_DTYPE = getattr(torch, os.environ.get("KERNELS_TEST_BIG_DTYPE", "bfloat16"))


def _reference_fp32(batch_args: tuple, sliding_window: int | None = None) -> torch.Tensor:
    q, k_cache, v_cache, tables, seq_lens, qsl, scale = batch_args
    return kernels.paged_attention(
        q.float(),
        k_cache.float(),
        v_cache.float(),
        tables,
        seq_lens,
        qsl,
        scale,
        backend="reference",
        sliding_window=sliding_window,
    )


@pytest.mark.parametrize(("ratio", "head_dim", "block_size"), PAIRWISE)
def test_bf16_mixed_batch(ratio: int, head_dim: int, block_size: int) -> None:
    batch = make_batch(mixed_spec(block_size), block_size, 2, ratio, head_dim, torch.bfloat16, device=DEVICE)
    out = kernels.paged_attention(*batch.args())  # auto: triton on CUDA
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference_fp32(batch.args()), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("ratio", "head_dim", "block_size"), PAIRWISE)
def test_bf16_decode_split_kv(ratio: int, head_dim: int, block_size: int) -> None:
    bs = block_size
    spec = [(2 * bs - 1, 1), (2 * bs, 1), (40 * bs - 2, 1), (0, 1), (64 * bs, 1)]
    batch = make_batch(spec, bs, 2, ratio, head_dim, torch.bfloat16, seed=ratio + bs, device=DEVICE)
    ref = _reference_fp32(batch.args())
    for splits in (None, 1, 7):
        out = decode_attention(*batch.args(), max_seq_len=64 * bs + 1, num_splits=splits)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("ratio", "head_dim", "block_size"), [(1, 64, 16), (4, 128, 8), (8, 64, 32)])
def test_fp32_matches_dense(ratio: int, head_dim: int, block_size: int) -> None:
    batch = make_batch(mixed_spec(block_size), block_size, 2, ratio, head_dim, device=DEVICE)
    out = kernels.paged_attention(*batch.args(), backend="triton")
    torch.testing.assert_close(out.double().cpu(), dense_attention(batch), atol=1e-5, rtol=1e-5)
    decode = make_batch([(5 * block_size, 1), (7, 1)], block_size, 2, ratio, head_dim, device=DEVICE, seed=5)
    out = decode_attention(*decode.args(), max_seq_len=5 * block_size + 1, num_splits=3)
    torch.testing.assert_close(out.double().cpu(), dense_attention(decode), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 16, 100, 4096])
def test_sliding_window(window: int) -> None:
    """Mixed, decode-only and long decode batches (block_size 16: window 16 is one block); the blocks before each
    sequence's first window hold NaN, so reading one shows."""
    long_decodes = [(64 * 16, 1), (40 * 16 - 2, 1), (300, 1)]
    for spec in (window_spec(16), window_decode_spec(16), long_decodes):
        batch = make_batch(spec, 16, 2, 4, 128, BIG_DTYPE, seed=window, device=DEVICE)
        ref = _reference_fp32(batch.args(), window)
        poison_before_window(batch, window)
        out = kernels.paged_attention(*batch.args(), sliding_window=window)
        assert out.dtype == BIG_DTYPE
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
        if spec is long_decodes:
            for splits in (1, 5):
                out = decode_attention(*batch.args(), 64 * 16 + 1, num_splits=splits, sliding_window=window)
                torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_block_ids_near_2_pow_20() -> None:
    bs, kvh, group, d = 16, 4, 4, 128  # 8,192 elements per block: block 2^20 starts at element 2^33
    num_blocks = BIG_NUM_BLOCKS
    k_cache = torch.zeros(num_blocks, bs, kvh, d, dtype=BIG_DTYPE, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    gen = torch.Generator().manual_seed(20)
    spec = [(40, 1), (3 * bs, 1), (2 * bs + 5, 20)]  # (cached, new)
    ids = (num_blocks - 1 - torch.randperm(24, generator=gen)).tolist()  # the 24 highest block ids, shuffled
    tables = torch.zeros(len(spec), 4, dtype=torch.int32)
    slots, k_new, v_new = [], [], []
    for i, (cached, new) in enumerate(spec):
        n_blocks = cdiv(cached + new, bs)
        tables[i, :n_blocks] = torch.tensor([ids.pop() for _ in range(n_blocks)], dtype=torch.int32)
        pos = torch.arange(cached + new)
        slots.append(tables[i, pos // bs].long() * bs + pos % bs)
        k_new.append(torch.randn(cached + new, kvh, d, generator=gen))
        v_new.append(torch.randn(cached + new, kvh, d, generator=gen))
    slot_mapping = torch.cat(slots).to(DEVICE)
    k_all = torch.cat(k_new).to(DEVICE, BIG_DTYPE)
    v_all = torch.cat(v_new).to(DEVICE, BIG_DTYPE)
    kernels.store_kv(k_all, v_all, k_cache, v_cache, slot_mapping)
    flat_k = k_cache.view(-1, kvh, d)
    assert torch.equal(flat_k[slot_mapping], k_all)
    assert torch.equal(v_cache.view(-1, kvh, d)[slot_mapping], v_all)

    q_lens = [new for _, new in spec]
    q = torch.randn(sum(q_lens), kvh * group, d, generator=gen).to(DEVICE, BIG_DTYPE)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([c + n for c, n in spec], dtype=torch.int32, device=DEVICE)
    tables = tables.to(DEVICE)
    out = kernels.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, d**-0.5)
    # Oracle on a compact cache: the same blocks renumbered 1..n.
    used = sorted({b for b in tables.flatten().tolist() if b})
    remap = torch.zeros(num_blocks, dtype=torch.int32, device=DEVICE)
    remap[torch.tensor(used, device=DEVICE)] = torch.arange(1, len(used) + 1, dtype=torch.int32, device=DEVICE)
    compact = (torch.cat([k_cache[:1], k_cache[used]]), torch.cat([v_cache[:1], v_cache[used]]))
    ref = _reference_fp32((q, *compact, remap[tables.long()], seq_lens, qsl, d**-0.5))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    decode_q = q[:2]
    out = decode_attention(decode_q, k_cache, v_cache, tables[:2], seq_lens[:2], qsl[:3], d**-0.5, 49, num_splits=2)
    ref = _reference_fp32((decode_q, *compact, remap[tables[:2].long()], seq_lens[:2], qsl[:3], d**-0.5))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)

    hi, lo = used[-1], 1
    kernels.copy_blocks(k_cache, v_cache, [(hi, lo)])
    assert torch.equal(k_cache[lo], k_cache[hi]) and torch.equal(v_cache[lo], v_cache[hi])


def test_128k_context() -> None:
    bs, kvh, group, d, context = 16, 8, 4, 128, LONG_CONTEXT
    n_blocks = context // bs
    gen = torch.Generator(device=DEVICE).manual_seed(128)
    shape = (n_blocks + 1, bs, kvh, d)
    k_cache = torch.randn(shape, generator=gen, device=DEVICE).to(BIG_DTYPE)
    v_cache = torch.randn(shape, generator=gen, device=DEVICE).to(BIG_DTYPE)
    tables = (torch.randperm(n_blocks, device=DEVICE) + 1).to(torch.int32)[None]
    seq_lens = torch.tensor([context], dtype=torch.int32, device=DEVICE)
    for new in (1, 16):
        q = torch.randn(new, kvh * group, d, generator=gen, device=DEVICE).to(BIG_DTYPE)
        qsl = torch.tensor([0, new], dtype=torch.int32, device=DEVICE)
        out = kernels.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, d**-0.5, new, context)
        ref = _reference_fp32((q, k_cache, v_cache, tables, seq_lens, qsl, d**-0.5))
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
        args = (q, k_cache, v_cache, tables, seq_lens, qsl, d**-0.5, new, context)
        out = kernels.paged_attention(*args, sliding_window=4096)
        ref = _reference_fp32((q, k_cache, v_cache, tables, seq_lens, qsl, d**-0.5), 4096)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
