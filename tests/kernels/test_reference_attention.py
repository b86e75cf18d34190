"""The torch reference path (the CPU serving path) against dense attention over contiguous K/V."""

from __future__ import annotations

import pytest
import torch

import kernels
from tests.kernels.kernel_cases import PAIRWISE, dense_attention, make_batch, mixed_spec


@pytest.mark.parametrize(("ratio", "head_dim", "block_size"), PAIRWISE)
def test_mixed_batch_matches_dense_fp32(ratio: int, head_dim: int, block_size: int) -> None:
    batch = make_batch(mixed_spec(block_size), block_size, num_kv_heads=2, group=ratio, head_dim=head_dim)
    out = kernels.paged_attention(*batch.args())
    assert out.dtype == torch.float32 and out.shape == batch.q.shape
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("ratio", "head_dim", "block_size"), [(1, 64, 16), (3, 64, 8), (8, 128, 32)])
def test_mixed_batch_matches_dense_bf16(ratio: int, head_dim: int, block_size: int) -> None:
    batch = make_batch(mixed_spec(block_size), block_size, 2, ratio, head_dim, dtype=torch.bfloat16, seed=1)
    out = kernels.paged_attention(*batch.args())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "spec",
    [
        [(0, 1)],  # one token, nothing cached
        [(15, 1), (16, 1), (17, 1), (31, 1)],  # decode-only batch at/around block multiples, reordered
        [(31, 1), (17, 1), (16, 1), (15, 1)],  # decode-only batch already longest first (no reordering)
        [(40, 1)] * 3,  # one length: one group, no mask
        [(32, 16), (0, 16), (5, 11)],  # extend/prefill only
    ],
)
def test_decode_only_and_extend_only_batches(spec: list[tuple[int, int]]) -> None:
    batch = make_batch(spec, 16, num_kv_heads=3, group=3, head_dim=64, seed=2)
    out = kernels.paged_attention(*batch.args(), backend="reference")
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_hints_do_not_change_the_result() -> None:
    batch = make_batch(mixed_spec(8), 8, 1, 4, 64, seed=3)
    plain = kernels.paged_attention(*batch.args())
    hinted = kernels.paged_attention(*batch.args(), max_query_len=15, max_seq_len=24)
    assert torch.equal(plain, hinted)


def test_auto_backend_is_reference_on_cpu() -> None:
    assert kernels.resolve_backend(None, torch.zeros(1)) == "reference"
    assert kernels.resolve_backend("auto", torch.zeros(1)) == "reference"
    with pytest.raises(kernels.UnknownBackend, match="cuda"):
        kernels.resolve_backend("cuda", torch.zeros(1))


def test_attention_rejects_mismatched_inputs() -> None:
    batch = make_batch([(3, 1)], 8, 2, 2, 64)
    with pytest.raises(kernels.KernelInputError, match="multiple"):
        kernels.paged_attention(batch.q[:, :3], *batch.args()[1:])
    with pytest.raises(kernels.KernelInputError, match="dtype"):
        kernels.paged_attention(batch.q.double(), *batch.args()[1:])
    with pytest.raises(kernels.KernelInputError, match="query_start_loc"):
        args = list(batch.args())
        args[5] = args[5][:1]
        kernels.paged_attention(*args)


@pytest.mark.parametrize("spec", [[(20, 1), (9, 1)], [(20, 1), (0, 12), (8, 3)]])
def test_strided_q_from_a_fused_qkv_projection(spec: list[tuple[int, int]]) -> None:
    batch = make_batch(spec, 8, num_kv_heads=3, group=3, head_dim=64, seed=6)
    num_tokens, num_heads, head_dim = batch.q.shape
    qkv = torch.randn(num_tokens, (num_heads + 6) * head_dim)
    qkv[:, : num_heads * head_dim] = batch.q.reshape(num_tokens, -1)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # row stride > num_heads * head_dim
    assert not q.is_contiguous()
    out = kernels.paged_attention(q, *batch.args()[1:])
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_pairwise_cover_has_every_pair() -> None:
    from tests.kernels.kernel_cases import BLOCK_SIZES, GQA_RATIOS, HEAD_DIMS, PAIRWISE

    assert {(r, d) for r, d, _ in PAIRWISE} == {(r, d) for r in GQA_RATIOS for d in HEAD_DIMS}
    assert {(r, b) for r, _, b in PAIRWISE} == {(r, b) for r in GQA_RATIOS for b in BLOCK_SIZES}
    assert {(d, b) for _, d, b in PAIRWISE} == {(d, b) for d in HEAD_DIMS for b in BLOCK_SIZES}
    assert len(PAIRWISE) == 12


def test_reference_works_inside_and_outside_inference_mode() -> None:
    """The reused gather workspace must accept writes whichever mode first allocated it (a serving step runs under
    torch.inference_mode; tests and tools may call the kernels outside it)."""
    from kernels import reference

    reference._workspaces.clear()
    batch = make_batch([(40, 1), (17, 1)], 16, num_kv_heads=2, group=3, head_dim=64, seed=4)
    with torch.inference_mode():
        inside = kernels.paged_attention(*batch.args(), backend="reference")
    outside = kernels.paged_attention(*batch.args(), backend="reference")
    torch.testing.assert_close(outside, inside.clone(), atol=0, rtol=0)
    torch.testing.assert_close(outside.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)
