"""kernels/cpu_decode.cpp computes the query heads of a KV group together (attend_tile's G) with each head's own
arithmetic: its output is bit for bit that of the kernel at benchmarks/cpu_decode_variant.BASE_COMMIT, which took
the heads one at a time. Both are built here (the old one from git history, under its own op name; cached after the
first run), natively and for AVX2 (-march=x86-64-v3: W = 8 vectors even on an AVX-512 machine), and compared with
torch.equal over group sizes 1 .. 9 (9: past MAX_GROUP, head by head), head_dims with whole and half bfloat16 pairs,
block sizes below, at and above the tile, sliding windows, ragged sequences and scores large enough for exp to
underflow. Needs the git history of this checkout."""

from __future__ import annotations

import itertools

import pytest
import torch

from benchmarks.cpu_decode_variant import AVX2, BASE_COMMIT, git_source, load_variant, renamed, tree_source
from kernels import cpu_decode
from runtime.model.cpu_features import cpu_flags
from tests.kernels.kernel_cases import make_batch

GROUPS = (1, 2, 3, 4, 8, 9)
HEAD_DIMS = (64, 256, 80, 128)  # 80: a bfloat16 row ends with half a pair (odd vector count) at W = 16
CASES = list(itertools.product((torch.float32, torch.bfloat16), (0, 37), (16, 8, 32), (1.0, 30.0)))


def ragged(block_size: int) -> list[tuple[int, int]]:
    """(cached_tokens, 1) per sequence: one token, lengths around block multiples, and a few hundred tokens."""
    bs = block_size
    return [(n - 1, 1) for n in (bs, 1, bs + 1, 3 * bs - 1, 2, 5 * bs + 7, 300 + bs // 2)]


def assert_same_bits(new, base, group: int, head_dim: int) -> None:
    """new and base give equal outputs (torch.equal) on every case of CASES for this group and head_dim."""
    for dtype, window, block_size, q_scale in CASES:
        seed = group * 1000 + head_dim + block_size
        batch = make_batch(ragged(block_size), block_size, 2, group, head_dim, dtype=dtype, seed=seed)
        q = (batch.q.float() * q_scale).to(dtype)  # x30: scores of hundreds, exp underflows, the max jumps
        args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.scale, window)
        got, want = new(*args), base(*args)
        case = f"{dtype} window {window} block {block_size} q x{q_scale}"
        assert got.isfinite().all() and got.abs().sum() > 0, case
        assert torch.equal(got, want), f"{case}: max difference {(got.float() - want.float()).abs().max()}"


@pytest.fixture(scope="module")
def base_source() -> tuple[bytes, bytes]:
    source = git_source(BASE_COMMIT)
    assert source != tree_source()  # the comparison is with the per-head kernel, not with this one
    return source


@pytest.mark.slow  # builds the base kernel on the first run on a machine (~20 s), then loads it from the cache
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_native_build_gives_the_bits_of_the_per_head_kernel(base_source, group: int, head_dim: int) -> None:
    new = cpu_decode.load_op()
    assert new is not None, "the operator did not build (see the warning logged by kernels.cpu_decode)"
    assert_same_bits(new, load_variant("gqa_base", *base_source), group, head_dim)


@pytest.mark.slow  # builds both kernels for AVX2 on the first run on a machine (~40 s), then loads them from the cache
@pytest.mark.skipif("avx2" not in cpu_flags() or "fma" not in cpu_flags(), reason="an x86-64-v3 build needs AVX2")
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS[:2])
def test_avx2_build_gives_the_bits_of_the_per_head_kernel(base_source, group: int, head_dim: int) -> None:
    new = load_variant("gqa_tree_avx2", *tree_source(), AVX2)
    assert_same_bits(new, load_variant("gqa_base_avx2", *base_source, AVX2), group, head_dim)


def test_renamed_moves_the_op_and_namespace_and_rejects_other_sources() -> None:
    cpp, header = tree_source()
    out = renamed(cpp, "radixserve_x")
    assert b"TORCH_LIBRARY(radixserve_x, m)" in out and b"TORCH_LIBRARY_IMPL(radixserve_x, CPU, m)" in out
    assert b"using namespace radixserve_x_cpu;" in out and b"TORCH_LIBRARY(radixserve," not in out
    assert b"namespace radixserve_x_cpu {" in renamed(header, "radixserve_x")
    with pytest.raises(ValueError, match="names neither"):
        renamed(b"int main() {}", "radixserve_x")
