"""The per-layer ops of a decode step in their cheaper forms (issue 24) equal the forms they replaced, bit for bit:
RMSNorm on a bfloat16 input without the float32 round trip, rotary as x * cos + roll(x) * sin_signed over q and k
heads side by side, its rows gathered once per positions tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.model.models.norms import RMSNorm
from runtime.model.models.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (3, 9, 64), (2, 2048)])
def test_rms_norm_without_the_float32_round_trip_is_bit_for_bit_the_same(dtype, shape):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(shape[-1], generator=g).to(dtype)
    norm = RMSNorm(weight, 1e-5)
    for scale in (0.01, 1.0, 30.0):
        x = (torch.randn(*shape, generator=g) * scale).to(dtype)
        before = weight * F.rms_norm(x.float(), (shape[-1],), None, 1e-5).to(dtype)  # the replaced form
        assert torch.equal(norm(x), before)


def _rope_reference(x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
    """The module docstring's form: x * cos + (-x2, x1) * sin over the first rotary_dim values of each head."""
    half, dim = rope.half_dim, rope.rotary_dim
    cos = rope.cos[positions].unsqueeze(1)
    sin = torch.cat((-rope.sin_signed[:, :half], rope.sin_signed[:, half:]), dim=-1)[positions].unsqueeze(1)
    r = x[..., :dim]
    rotated = r * cos + torch.cat((-r[..., half:], r[..., :half]), dim=-1) * sin
    return torch.cat((rotated, x[..., dim:]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (96, 72)])  # full, and Phi-4-mini's partial 0.75
def test_rotary_of_q_and_k_side_by_side_equals_the_reference(dtype, head_dim, rotary_dim):
    rope = RotaryEmbedding(rotary_dim, 256, 10000.0, "default", {}, dtype, "cpu")
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (9 + 3 + 3) * head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 7, 8, 100, 255])
    qk = qkv[:, : 12 * head_dim].view(5, 12, head_dim)  # strided rows, as the attention's qkv slice
    got = rope(positions, qk)
    assert torch.equal(got, _rope_reference(qk, positions, rope))
    assert torch.equal(got[:, :9], rope(positions, qk[:, :9]))  # q alone == q's part of q and k together


def test_rotary_rows_follow_the_positions_tensor():
    rope = RotaryEmbedding(8, 64, 10000.0, "default", {}, torch.float32, "cpu")
    x = torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(2))
    first = torch.tensor([3])
    a = rope(first, x)
    again = rope(first, x)  # same tensor: the rows gathered for it are reused
    other = rope(torch.tensor([4]), x)  # a new tensor (even of a close value) is gathered anew
    assert torch.equal(a, again) and torch.equal(a, _rope_reference(x, first, rope))
    assert torch.equal(other, _rope_reference(x, torch.tensor([4]), rope)) and not torch.equal(other, a)
