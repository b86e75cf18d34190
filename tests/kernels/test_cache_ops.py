"""store_kv, copy_blocks and swap_blocks on the reference backend, exact values."""

from __future__ import annotations

import pytest
import torch

import kernels


def _cache(num_blocks: int = 6, block_size: int = 4, kv_heads: int = 2, head_dim: int = 8) -> torch.Tensor:
    return torch.arange(num_blocks * block_size * kv_heads * head_dim, dtype=torch.float32).view(
        num_blocks, block_size, kv_heads, head_dim
    )


def test_store_kv_writes_slots_and_skips_padding() -> None:
    k_cache, v_cache = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    k = torch.arange(3 * 2 * 8, dtype=torch.float32).view(3, 2, 8) + 1
    v = -k
    slots = torch.tensor([9, -1, 22], dtype=torch.int64)  # block 2 offset 1, padding, block 5 offset 2
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(k_cache[5, 2], k[2])
    assert torch.equal(v_cache[2, 1], v[0]) and torch.equal(v_cache[5, 2], v[2])
    written = (k_cache != 0).any(-1).any(-1).nonzero().tolist()
    assert written == [[2, 1], [5, 2]]


def test_store_kv_all_padding_writes_nothing() -> None:
    k_cache, v_cache = torch.zeros(3, 4, 1, 8), torch.zeros(3, 4, 1, 8)
    kernels.store_kv(torch.ones(2, 1, 8), torch.ones(2, 1, 8), k_cache, v_cache, torch.tensor([-1, -1]))
    assert int(k_cache.count_nonzero()) == 0 and int(v_cache.count_nonzero()) == 0


def test_store_kv_into_a_layer_view_of_the_all_layer_cache() -> None:
    all_k, all_v = torch.zeros(3, 5, 4, 1, 8), torch.zeros(3, 5, 4, 1, 8)
    kernels.store_kv(torch.ones(1, 1, 8), 2 * torch.ones(1, 1, 8), all_k[1], all_v[1], torch.tensor([13]))
    assert all_k[1, 3, 1].tolist() == [[1.0] * 8] and all_v[1, 3, 1].tolist() == [[2.0] * 8]
    assert int(all_k.count_nonzero()) == 8 and int(all_v.count_nonzero()) == 8


def test_store_kv_rejects_bad_shapes() -> None:
    k_cache = torch.zeros(3, 4, 2, 8)
    with pytest.raises(kernels.KernelInputError, match="slot_mapping"):
        kernels.store_kv(torch.ones(2, 2, 8), torch.ones(2, 2, 8), k_cache, k_cache.clone(), torch.tensor([1]))
    with pytest.raises(kernels.KernelInputError, match="does not match"):
        kernels.store_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), k_cache, k_cache.clone(), torch.tensor([1]))


def test_copy_blocks_reads_before_writes() -> None:
    k_cache, v_cache = _cache(), -_cache()
    k0, v0 = k_cache.clone(), v_cache.clone()
    kernels.copy_blocks(k_cache, v_cache, [(1, 2), (2, 3)])
    assert torch.equal(k_cache[2], k0[1]) and torch.equal(k_cache[3], k0[2])
    assert torch.equal(v_cache[2], v0[1]) and torch.equal(v_cache[3], v0[2])
    for b in (0, 1, 4, 5):
        assert torch.equal(k_cache[b], k0[b]) and torch.equal(v_cache[b], v0[b])


def test_copy_blocks_on_the_all_layer_tensor() -> None:
    k_cache = torch.stack([_cache(), 2 * _cache()])
    v_cache = -k_cache
    k0 = k_cache.clone()
    kernels.copy_blocks(k_cache, v_cache, torch.tensor([[4, 1]]))
    assert torch.equal(k_cache[:, 1], k0[:, 4]) and torch.equal(v_cache[:, 1], -k0[:, 4])
    assert torch.equal(k_cache[:, [0, 2, 3, 4, 5]], k0[:, [0, 2, 3, 4, 5]])


def test_copy_blocks_rejects_bad_pairs() -> None:
    k_cache, v_cache = _cache(), _cache()
    with pytest.raises(kernels.KernelInputError, match="out of range"):
        kernels.copy_blocks(k_cache, v_cache, [(1, 6)])
    with pytest.raises(kernels.KernelInputError, match="twice"):
        kernels.copy_blocks(k_cache, v_cache, [(1, 2), (3, 2)])


def test_swap_blocks_between_caches_of_different_sizes() -> None:
    device_cache = torch.stack([_cache(), 3 * _cache()])  # [layers, 6 blocks, ...]
    host_cache = torch.zeros(2, 3, 4, 2, 8)  # [layers, 3 host blocks, ...]
    kernels.swap_blocks(device_cache, host_cache, [(5, 0), (2, 2)])
    assert torch.equal(host_cache[:, 0], device_cache[:, 5]) and torch.equal(host_cache[:, 2], device_cache[:, 2])
    assert int(host_cache[:, 1].count_nonzero()) == 0
    restored = torch.zeros_like(device_cache)
    kernels.swap_blocks(host_cache, restored, [(0, 1), (2, 4)])
    assert torch.equal(restored[:, 1], device_cache[:, 5]) and torch.equal(restored[:, 4], device_cache[:, 2])
    assert int(restored[:, [0, 2, 3, 5]].count_nonzero()) == 0


def test_swap_blocks_rejects_mismatched_caches() -> None:
    with pytest.raises(kernels.KernelInputError, match="dtype"):
        kernels.swap_blocks(_cache(), torch.zeros(3, 4, 2, 8, dtype=torch.float64), [(0, 0)])
    with pytest.raises(kernels.KernelInputError, match="out of range"):
        kernels.swap_blocks(_cache(), torch.zeros(3, 4, 2, 8), [(0, 3)])
