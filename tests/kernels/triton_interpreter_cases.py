"""Triton kernels on the CPU under TRITON_INTERPRET=1, against the reference and dense attention (tiny shapes).

Run by test_triton_interpreter.py in a subprocess, so the interpreter setting never leaks into the rest of the suite.
TRITON_INTERPRET must be set before triton is imported, hence the assignment above the imports.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import kernels  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.triton_decode import decode_attention  # noqa: E402
from tests.kernels.kernel_cases import (  # noqa: E402
    PAIRWISE,
    dense_attention,
    make_batch,
    mixed_spec,
    poison_before_window,
    window_decode_spec,
    window_spec,
)
from tests.kernels.scattered_blocks_case import run_c10  # noqa: E402


@pytest.mark.parametrize(("ratio", "head_dim", "block_size"), PAIRWISE)
def test_mixed_batch_extend_kernel(ratio: int, head_dim: int, block_size: int) -> None:
    batch = make_batch(mixed_spec(block_size), block_size, num_kv_heads=1, group=ratio, head_dim=head_dim)
    out = kernels.paged_attention(*batch.args(), backend="triton")
    ref = kernels.paged_attention(*batch.args(), backend="reference")
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("ratio", "head_dim", "block_size"), PAIRWISE)
def test_decode_batch_split_kv(ratio: int, head_dim: int, block_size: int) -> None:
    bs = block_size
    spec = [(2 * bs - 1, 1), (2 * bs, 1), (5 * bs - 2, 1), (0, 1), (8 * bs, 1)]
    batch = make_batch(spec, bs, num_kv_heads=1, group=ratio, head_dim=head_dim, seed=ratio + bs)
    expected = dense_attention(batch)
    for num_splits in (1, 3):
        out = decode_attention(*batch.args(), max_seq_len=8 * bs + 1, num_splits=num_splits)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    out = kernels.paged_attention(*batch.args(), max_query_len=1, max_seq_len=8 * bs + 1, backend="triton")
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_two_kv_heads_and_hints() -> None:
    batch = make_batch(mixed_spec(8), 8, num_kv_heads=2, group=3, head_dim=64, seed=7)
    out = kernels.paged_attention(*batch.args(), max_query_len=15, max_seq_len=24, backend="triton")
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_store_kv_kernel_matches_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(6, 8, 3, 64, generator=gen)
    v_cache = torch.randn(6, 8, 3, 64, generator=gen)
    k = torch.randn(5, 3, 64, generator=gen)
    v = torch.randn(5, 3, 64, generator=gen)
    slots = torch.tensor([17, -1, 40, 7, -1])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, k_ref, v_ref, slots)
    kernels.store_kv(k, v, k_cache, v_cache, slots, backend="triton")
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    kernels.store_kv(k[:1], v[:1], k_cache, v_cache, torch.tensor([6 * 8]), backend="triton")  # past the cache
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_copy_blocks_kernel_on_layer_and_all_layer_caches() -> None:
    gen = torch.Generator().manual_seed(4)
    all_k = torch.randn(2, 6, 8, 1, 64, generator=gen)
    all_v = torch.randn(2, 6, 8, 1, 64, generator=gen)
    k_ref, v_ref = all_k.clone(), all_v.clone()
    reference.copy_blocks(k_ref, v_ref, [(1, 4), (2, 5)])
    kernels.copy_blocks(all_k, all_v, [(1, 4), (2, 5)], backend="triton")
    assert torch.equal(all_k, k_ref) and torch.equal(all_v, v_ref)
    reference.copy_blocks(k_ref[1], v_ref[1], [(3, 2), (2, 1)])  # chained: falls back to read-all-then-write
    kernels.copy_blocks(all_k[1], all_v[1], [(3, 2), (2, 1)], backend="triton")
    assert torch.equal(all_k, k_ref) and torch.equal(all_v, v_ref)


def test_c10_scattered_blocks_triton() -> None:
    run_c10("triton")


def test_strided_q_from_a_fused_qkv_projection() -> None:
    batch = make_batch([(20, 1), (0, 12), (8, 3)], 8, num_kv_heads=1, group=3, head_dim=64, seed=6)
    num_tokens, num_heads, head_dim = batch.q.shape
    qkv = torch.randn(num_tokens, (num_heads + 2) * head_dim)
    qkv[:, : num_heads * head_dim] = batch.q.reshape(num_tokens, -1)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    out = kernels.paged_attention(q, *batch.args()[1:], backend="triton")
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)
    decode = make_batch([(20, 1), (9, 1)], 8, num_kv_heads=1, group=3, head_dim=64, seed=8)
    qkv = torch.randn(2, (num_heads + 2) * head_dim)
    qkv[:, : num_heads * head_dim] = decode.q.reshape(2, -1)
    q = qkv[:, : num_heads * head_dim].view(2, num_heads, head_dim)
    out = decode_attention(q, *decode.args()[1:], max_seq_len=21, num_splits=2)
    torch.testing.assert_close(out.double(), dense_attention(decode), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 8, 16, 1000])
def test_sliding_window_extend_kernel(window: int) -> None:
    """Mixed batch (block_size 8: window 8 is one block) through the extend kernel; the blocks before each
    sequence's first window hold NaN, so reading one shows."""
    batch = make_batch(window_spec(8), 8, num_kv_heads=1, group=2, head_dim=64, seed=window)
    want = dense_attention(batch, window)
    poison_before_window(batch, window)
    out = kernels.paged_attention(*batch.args(), backend="triton", sliding_window=window)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 8, 16, 1000])
def test_sliding_window_decode_split_kv(window: int) -> None:
    batch = make_batch(window_decode_spec(8), 8, num_kv_heads=2, group=2, head_dim=64, seed=window)
    want = dense_attention(batch, window)
    poison_before_window(batch, window)
    for num_splits in (1, 3):
        out = decode_attention(*batch.args(), max_seq_len=61, num_splits=num_splits, sliding_window=window)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    out = kernels.paged_attention(*batch.args(), max_query_len=1, backend="triton", sliding_window=window)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
