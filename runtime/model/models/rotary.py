"""Rotary position embeddings (RoFormer, Su et al. 2021, section 3.4) with the rope scalings of the supported families.

The rotation is the "rotate half" form of the Hugging Face Llama implementation: for a head vector x split into
halves (x1, x2), rope(x) = x * cos + (-x2, x1) * sin with cos/sin = cos/sin(pos * inv_freq) repeated over both halves.
With a partial rotary factor (Phi-4-mini) only the first rotary_dim values of each head are rotated, the rest pass.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(
    rotary_dim: int, theta: float, rope_type: str, scaling: dict[str, Any], max_positions: int
) -> torch.Tensor:
    """Inverse frequencies, float32 [rotary_dim // 2]: theta^(-2i/rotary_dim), then scaled by rope_type.

    "linear": divided by factor (Chen et al. 2023, position interpolation). "llama3": low frequencies divided by
    factor, high ones kept, the band between interpolated smoothly (Llama 3.1 reference code, apply_scaling).
    "longrope" (Phi-3; Ding et al. 2024, LongRoPE): each frequency divided by its own rescale factor, long_factor
    when the served context (max_positions) exceeds original_max_position_embeddings, else short_factor. The choice
    is made once, for every position (as llama.cpp picks its rope factors from the context size), so a sequence's KV
    is rotated one way; transformers picks per forward, which agrees whenever a context stays on one side.

    Raises:
        ValueError: an unknown rope_type (the loader rejects those before).
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float) / rotary_dim
    if rope_type == "longrope":
        long = max_positions > int(scaling["original_max_position_embeddings"])
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
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


def attention_factor(rope_type: str, scaling: dict[str, Any]) -> float:
    """The factor cos and sin are multiplied by: 1, except for longrope, where it is the config's attention_factor,
    else sqrt(1 + ln(s) / ln(original)) for s = factor (default max_position_embeddings / original) > 1
    (LongRoPE's attention scaling, as transformers computes it)."""
    if rope_type != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or int(scaling["max_position_embeddings"]) / original)
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for positions [0, max_positions), applied to q and k heads in place of a per-step computation.

    Buffers cos, sin_signed: [max_positions, rotary_dim], dtype of the model (rotary_dim <= head_dim, even; the first
    rotary_dim values of each head are rotated); sin_signed is sin with its first half negated, so that
    rope(x) = x * cos + roll(x, rotary_dim / 2) * sin_signed, bit for bit the module docstring's form (a negation is
    exact) in 3 ops instead of 6. Scaling parameters: inv_frequencies and attention_factor. The rows of the step's
    positions are gathered once per positions tensor (every layer of a step passes the same one), not per layer.
    """

    cos: torch.Tensor
    sin_signed: torch.Tensor

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        theta: float,
        rope_type: str,
        scaling: dict[str, Any],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        inv_freq = inv_frequencies(rotary_dim, theta, rope_type, scaling, max_positions)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = attention_factor(rope_type, scaling)
        cos = emb.cos() if factor == 1.0 else emb.cos() * factor
        sin = emb.sin() if factor == 1.0 else emb.sin() * factor
        sin_signed = torch.cat((-sin[:, : rotary_dim // 2], sin[:, rotary_dim // 2 :]), dim=-1)
        self.register_buffer("cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin_signed", sin_signed.to(device=device, dtype=dtype), persistent=False)
        self.rotary_dim = rotary_dim
        self.half_dim = rotary_dim // 2
        self._positions: torch.Tensor | None = None  # the positions whose rows _rows holds
        self._rows: tuple[torch.Tensor, torch.Tensor] = (self.cos[:0], self.sin_signed[:0])

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, D] (q heads, k heads, or both side by side; any strides) by positions int64 [T]; returns
        a new contiguous tensor (x unchanged)."""
        cos, sin = self._tables(positions)
        if x.shape[-1] != self.rotary_dim:
            rotated = self._rotate(x[..., : self.rotary_dim], cos, sin)
            return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)
        return self._rotate(x, cos, sin)

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # identity, not value: holding the last positions tensor keeps its id from being reused by a new one
        if positions is not self._positions:
            cos = self.cos.index_select(0, positions).unsqueeze(1)
            sin = self.sin_signed.index_select(0, positions).unsqueeze(1)
            self._rows = (cos, sin)
            self._positions = positions
        return self._rows

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + torch.roll(x, self.half_dim, dims=-1) * sin
