"""Rotary position embeddings (RoFormer, Su et al. 2021, section 3.4) with the rope scalings of the Llama family.

The rotation is the "rotate half" form of the Hugging Face Llama implementation: for a head vector x split into
halves (x1, x2), rope(x) = x * cos + (-x2, x1) * sin with cos/sin = cos/sin(pos * inv_freq) repeated over both halves.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(head_dim: int, theta: float, rope_type: str, scaling: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies, float32 [head_dim // 2]: theta^(-2i/head_dim), then scaled by rope_type.

    "linear": divided by factor (Chen et al. 2023, position interpolation). "llama3": low frequencies divided by
    factor, high ones kept, the band between interpolated smoothly (Llama 3.1 reference code, apply_scaling).

    Raises:
        ValueError: an unknown rope_type (the loader rejects those before).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_type!r}")
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for positions [0, max_positions), applied to q and k in place of a per-step computation.

    Buffers cos, sin: [max_positions, head_dim], dtype of the model.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        rope_type: str,
        scaling: dict[str, Any],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        inv_freq = inv_frequencies(head_dim, theta, rope_type, scaling)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(device=device, dtype=dtype), persistent=False)
        self.half_dim = head_dim // 2

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hk, D] by positions int64 [T]; returns new tensors (inputs unchanged)."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1 = x[..., : self.half_dim]
        x2 = x[..., self.half_dim :]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
