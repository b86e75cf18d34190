"""kernels/cpu_decode.cpp computes the query heads of a KV group together (attend_tile's G) with each head's own
arithmetic: the output of a group of G query heads is bit for bit that of the same heads, each with its own copy of
the group's K/V head (group 1: the kernel takes one query row at a time), which is also what the kernel computed
before it grouped them (benchmarks/attention_gqa_cpu.py compares with that commit's build: max difference 0). Built
natively and for AVX2 (-march=x86-64-v3: W = 8 vectors even on an AVX-512 machine, a copy of this checkout's kernel
under its own op name; cached after the first run), compared with torch.equal over group sizes 1 .. 9 (9: past
MAX_GROUP, head by head), head_dims with whole and half bfloat16 pairs, block sizes below, at and above the tile,
sliding windows, ragged sequences and scores large enough for exp to underflow."""

from __future__ import annotations

import itertools

import pytest
import torch

from benchmarks.cpu_decode_variant import AVX2, load_variant, renamed, tree_source
from kernels import cpu_decode
from runtime.model.cpu_features import cpu_flags
from tests.kernels.kernel_cases import make_batch

GROUPS = (1, 2, 3, 4, 8, 9)
HEAD_DIMS = (64, 256, 80, 128)  # 80: a bfloat16 row ends with half a pair (odd vector count) at W = 16
CASES = list(itertools.product((torch.float32, torch.bfloat16), (0, 37), (16, 8, 32), (1.0, 30.0)))
KV_HEADS = 2


def ragged(block_size: int) -> list[tuple[int, int]]:
    """(cached_tokens, 1) per sequence: one token, lengths around block multiples, and a few hundred tokens."""
    bs = block_size
    return [(n - 1, 1) for n in (bs, 1, bs + 1, 3 * bs - 1, 2, 5 * bs + 7, 300 + bs // 2)]


def assert_grouped_is_head_by_head(op, group: int, head_dim: int) -> None:
    """op on KV_HEADS KV heads of `group` query heads each equals (torch.equal) op on the same query heads with each
    KV head copied `group` times (group 1), on every case of CASES."""
    for dtype, window, block_size, q_scale in CASES:
        seed = group * 1000 + head_dim + block_size
        batch = make_batch(ragged(block_size), block_size, KV_HEADS, group, head_dim, dtype=dtype, seed=seed)
        q = (batch.q.float() * q_scale).to(dtype)  # x30: scores of hundreds, exp underflows, the max jumps
        k_own = batch.k_cache.repeat_interleave(group, dim=2)  # [blocks, block_size, KV_HEADS * group, head_dim]
        v_own = batch.v_cache.repeat_interleave(group, dim=2)
        rest = (batch.block_tables, batch.seq_lens, batch.scale, window)
        got = op(q, batch.k_cache, batch.v_cache, *rest)
        want = op(q, k_own, v_own, *rest)
        case = f"{dtype} window {window} block {block_size} q x{q_scale}"
        assert got.isfinite().all() and got.abs().sum() > 0, case
        assert torch.equal(got, want), f"{case}: max difference {(got.float() - want.float()).abs().max()}"


@pytest.mark.slow  # ~10 s: 6 x 4 x 16 kernel pairs
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_native_build_groups_heads_with_each_heads_own_bits(group: int, head_dim: int) -> None:
    op = cpu_decode.load_op()
    assert op is not None, "the operator did not build (see the warning logged by kernels.cpu_decode)"
    assert_grouped_is_head_by_head(op, group, head_dim)


@pytest.mark.slow  # builds the kernel for AVX2 on the first run on a machine (~20 s), then loads it from the cache
@pytest.mark.skipif("avx2" not in cpu_flags() or "fma" not in cpu_flags(), reason="an x86-64-v3 build needs AVX2")
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS[:2])
def test_avx2_build_groups_heads_with_each_heads_own_bits(group: int, head_dim: int) -> None:
    assert_grouped_is_head_by_head(load_variant("gqa_tree_avx2", *tree_source(), AVX2), group, head_dim)


def test_renamed_moves_the_op_and_namespace_and_rejects_other_sources() -> None:
    cpp, header = tree_source()
    out = renamed(cpp, "radixserve_x")
    assert b"TORCH_LIBRARY(radixserve_x, m)" in out and b"TORCH_LIBRARY_IMPL(radixserve_x, CPU, m)" in out
    assert b"using namespace radixserve_x_cpu;" in out and b"TORCH_LIBRARY(radixserve," not in out
    assert b"namespace radixserve_x_cpu {" in renamed(header, "radixserve_x")
    with pytest.raises(ValueError, match="names neither"):
        renamed(b"int main() {}", "radixserve_x")
