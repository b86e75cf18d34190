"""The fused C decode kernel (kernels/cpu_decode.py) against dense attention; the torch fallback without a compiler."""

from __future__ import annotations

import logging

import pytest
import torch
from kernel_cases import PAIRWISE, dense_attention, make_batch

import kernels
from kernels import cpu_decode
from kernels.errors import KernelInputError


def decode_spec(block_size: int) -> list[tuple[int, int]]:
    """(cached_tokens, 1) per sequence: lengths at, one under and one over block multiples, and one-token sequences."""
    bs = block_size
    lengths = [bs, bs - 1, bs + 1, 2 * bs, 3 * bs - 1, 3 * bs + 1, 1, 5 * bs + 7, 1, 2]
    return [(n - 1, 1) for n in lengths]


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory) -> str:
    """One cache folder for the module: the kernel is built once, not per test."""
    return str(tmp_path_factory.mktemp("radixserve_cache"))


@pytest.fixture(autouse=True)
def kernel_cache(module_cache, monkeypatch):
    """Build into the module's cache folder; the C path on, whatever the environment says."""
    monkeypatch.setenv("RADIXSERVE_CACHE", module_cache)
    monkeypatch.setattr(cpu_decode, "ENABLED", True)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache folder and no library loaded: the next call builds (or fails to)."""
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_decode, "_libraries", {})


@pytest.mark.parametrize(("ratio", "head_dim", "block_size"), PAIRWISE)
def test_c_kernel_matches_dense_fp32(ratio: int, head_dim: int, block_size: int) -> None:
    batch = make_batch(decode_spec(block_size), block_size, num_kv_heads=2, group=ratio, head_dim=head_dim, seed=ratio)
    lens = batch.seq_lens.tolist()
    out = cpu_decode.paged_decode(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, lens, batch.scale)
    assert out is not None
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_head_dim_without_a_specialised_path() -> None:
    batch = make_batch(decode_spec(16), 16, num_kv_heads=2, group=5, head_dim=80, seed=11)
    out = kernels.paged_attention(*batch.args())
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_paged_attention_takes_the_c_kernel(threads: int, monkeypatch) -> None:
    calls = []
    original = cpu_decode.paged_decode
    monkeypatch.setattr(cpu_decode, "paged_decode", lambda *a: calls.append(1) or original(*a))
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = make_batch(decode_spec(16), 16, num_kv_heads=3, group=3, head_dim=64, seed=7)
        out = kernels.paged_attention(*batch.args())
    finally:
        torch.set_num_threads(saved)
    assert calls == [1]
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_strided_q_and_shuffled_order() -> None:
    batch = make_batch(decode_spec(8)[::-1], 8, num_kv_heads=4, group=2, head_dim=64, seed=3)
    qkv = torch.cat([batch.q, torch.randn(batch.q.shape[0], 4, 64)], dim=1)  # q as a view of a fused projection
    batch.q = qkv[:, :8]
    out = kernels.paged_attention(*batch.args())
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_bf16_and_non_contiguous_caches_keep_the_torch_path() -> None:
    batch = make_batch(decode_spec(16), 16, num_kv_heads=2, group=2, head_dim=64)
    assert cpu_decode.supports(batch.q, batch.k_cache, batch.v_cache)
    bf16 = batch.q.bfloat16()
    assert not cpu_decode.supports(bf16, batch.k_cache.bfloat16(), batch.v_cache.bfloat16())
    strided = batch.k_cache.transpose(1, 2)
    assert not cpu_decode.supports(batch.q, strided, strided)


def test_block_out_of_range_raises() -> None:
    batch = make_batch(decode_spec(8), 8, num_kv_heads=1, group=1, head_dim=64)
    tables = batch.block_tables.clone()
    tables[0, 0] = batch.k_cache.shape[0]
    lens = batch.seq_lens.tolist()
    with pytest.raises(KernelInputError, match="outside the cache"):
        cpu_decode.paged_decode(batch.q, batch.k_cache, batch.v_cache, tables, lens, batch.scale)
    with pytest.raises(KernelInputError, match="too short"):
        cpu_decode.paged_decode(batch.q, batch.k_cache, batch.v_cache, tables[:, :1], lens, batch.scale)


def test_build_is_cached_by_source_hash(fresh_cache, tmp_path) -> None:
    assert cpu_decode.load_library() is not None
    built = sorted(p.name for p in (tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].startswith("cpu_decode-") and built[0].endswith(".so")
    cpu_decode._libraries.clear()
    assert cpu_decode.load_library() is not None
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == built


def test_missing_compiler_falls_back_with_one_warning(fresh_cache, monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpu_decode, "COMPILER", "radixserve-no-such-cc")
    batch = make_batch(decode_spec(16), 16, num_kv_heads=3, group=3, head_dim=64, seed=5)
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_decode"):
        first = kernels.paged_attention(*batch.args())
        second = kernels.paged_attention(*batch.args())
    warnings = [r for r in caplog.records if r.name == "kernels.cpu_decode" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "radixserve-no-such-cc" in warnings[0].getMessage()
    assert cpu_decode.load_library() is None
    torch.testing.assert_close(first.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second, first, atol=0, rtol=0)
