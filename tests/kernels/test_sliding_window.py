"""Sliding-window attention on the CPU paths (torch reference, gather + SDPA, and the fused C++ decode operator)
against dense float64 attention with an explicit mask; the mask's off-by-one against transformers' own function.

The Triton kernels run the same cases under the interpreter (triton_interpreter_cases.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function

import kernels
from kernels import cpu_decode, reference
from tests.kernels.kernel_cases import dense_attention, make_batch, poison_before_window, window_mask

WINDOWS = (1, 3, 16, 1000)  # 1000: larger than every context here
F32_TOL = 1e-5


def window_spec(block_size: int) -> list[tuple[int, int]]:
    """(cached_tokens, query_len) per sequence: decodes short and long, an extend whose window reaches back into
    its prefix, a fresh prefill longer than the windows, and a late chunk of a long prompt (its prefix mostly
    outside every window but the largest)."""
    bs = block_size
    return [(0, 1), (bs - 1, 1), (2 * bs, 1), (5 * bs + 3, 1), (7 * bs - 1, 1), (2 * bs + 5, 9), (0, 3 * bs + 2)] + [
        (6 * bs, bs + 1)
    ]


def decode_spec(block_size: int) -> list[tuple[int, int]]:
    bs = block_size
    return [(n - 1, 1) for n in (1, bs - 1, bs, bs + 1, 3 * bs, 5 * bs + 7, 2, 8 * bs - 3)]


@pytest.fixture(params=[True, False], ids=["fused", "gather"])
def fused(request, monkeypatch) -> bool:
    """Decode through the fused C++ operator, or with it off through gather + SDPA (kernels/reference.py)."""
    monkeypatch.setattr(cpu_decode, "ENABLED", request.param)
    return request.param


def test_mask_is_transformers_sliding_window_mask() -> None:
    """window_mask (the oracle's) equals transformers' sliding_window_causal_mask_function, which Mistral and
    Gemma 3's local layers use: key k is visible from query p iff p - W < k <= p."""
    for window in (1, 3, 5):
        mask_fn = sliding_window_causal_mask_function(window)
        zero = torch.tensor(0)
        theirs = mask_fn(zero, zero, torch.arange(12)[:, None], torch.arange(12)[None, :])
        assert torch.equal(window_mask(torch.arange(12), 12, window), theirs)
        assert int(theirs[11].sum()) == window  # the last `window` positions, itself included


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [8, 16])
def test_mixed_batch_fp32(fused: bool, window: int, block_size: int) -> None:
    batch = make_batch(window_spec(block_size), block_size, num_kv_heads=2, group=3, head_dim=64, seed=window)
    want = dense_attention(batch, window)
    poisoned = poison_before_window(batch, window)
    assert poisoned > 0 or window == 1000
    out = kernels.paged_attention(*batch.args(), sliding_window=window)
    torch.testing.assert_close(out.double(), want, atol=F32_TOL, rtol=F32_TOL)


@pytest.mark.parametrize("window", WINDOWS)
def test_decode_only_batch_fp32_and_bf16(fused: bool, window: int) -> None:
    for dtype, tol in ((torch.float32, F32_TOL), (torch.bfloat16, 2e-2)):
        batch = make_batch(decode_spec(8), 8, num_kv_heads=2, group=4, head_dim=64, dtype=dtype, seed=window)
        want = dense_attention(batch, window)
        poison_before_window(batch, window)
        out = kernels.paged_attention(*batch.args(), max_query_len=1, sliding_window=window)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [3, 16])
def test_mixed_batch_bf16(fused: bool, window: int) -> None:
    batch = make_batch(window_spec(16), 16, num_kv_heads=1, group=8, head_dim=128, dtype=torch.bfloat16, seed=9)
    want = dense_attention(batch, window)
    poison_before_window(batch, window)
    out = kernels.paged_attention(*batch.args(), sliding_window=window)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("head_dim", "window"), [(80, 5), (48, 16), (64, 9)])
def test_fused_operator_directly(head_dim: int, window: int) -> None:
    """The C++ operator's generic head_dim path (80, 48: a half chunk of bf16 rows) and its head_dim 64 path."""
    for dtype, tol in ((torch.float32, F32_TOL), (torch.bfloat16, 2e-2)):
        batch = make_batch(decode_spec(16), 16, num_kv_heads=2, group=3, head_dim=head_dim, dtype=dtype, seed=4)
        want = dense_attention(batch, window)
        poison_before_window(batch, window)
        out = cpu_decode.paged_decode(*batch.args()[:5], batch.scale, window)
        assert out is not None, "the operator did not build (see the warning logged by kernels.cpu_decode)"
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def test_window_zero_and_none_are_full_attention(fused: bool) -> None:
    batch = make_batch(window_spec(8), 8, num_kv_heads=2, group=2, head_dim=64, seed=3)
    full = kernels.paged_attention(*batch.args())
    assert torch.equal(kernels.paged_attention(*batch.args(), sliding_window=0), full)
    assert torch.equal(kernels.paged_attention(*batch.args(), sliding_window=None), full)
    torch.testing.assert_close(full.double(), dense_attention(batch), atol=F32_TOL, rtol=F32_TOL)


def test_long_prefill_runs_in_query_chunks(monkeypatch) -> None:
    """A windowed prefill longer than a query chunk: chunk boundaries at, inside and past the window."""
    monkeypatch.setattr(reference, "WINDOW_QUERY_CHUNK", 8)
    spec = [(0, 45), (19, 30), (3, 17)]
    for window in (3, 8, 11):
        batch = make_batch(spec, 8, num_kv_heads=1, group=2, head_dim=64, seed=window)
        want = dense_attention(batch, window)
        poison_before_window(batch, window)
        out = kernels.paged_attention(*batch.args(), sliding_window=window)
        torch.testing.assert_close(out.double(), want, atol=F32_TOL, rtol=F32_TOL)


@pytest.mark.parametrize("bad", [-1, 2.5, True, "16"])
def test_bad_window_is_a_kernel_input_error(bad: object) -> None:
    batch = make_batch([(3, 1)], 8, 1, 1, 64)
    with pytest.raises(kernels.KernelInputError, match="sliding_window must be None or an int >= 0"):
        kernels.paged_attention(*batch.args(), sliding_window=bad)  # type: ignore[arg-type]


def test_fused_operator_rejects_a_negative_window() -> None:
    batch = make_batch([(3, 1)], 8, 1, 1, 64)
    with pytest.raises(kernels.KernelInputError, match="sliding_window must be >= 0"):
        cpu_decode.paged_decode(*batch.args()[:5], batch.scale, -2)
