"""RMSNorm (Zhang & Sennrich 2019) in the two forms the families use: Llama's w * norm(x) and Gemma's norm(x) * (1 + w).

Both normalise in float32 as transformers does (torch's rms_norm computes in float32 for a bfloat16 input); they
differ in where the result is rounded to the model dtype (Llama rounds norm(x) then multiplies by w in the model
dtype; Gemma multiplies in float32 and rounds once), which matters in bfloat16 only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.models.weights import frozen


class RMSNorm(torch.nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), the normalisation in float32 (transformers' LlamaRMSNorm)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = frozen(weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim], dtype of x; normalised over the last dimension."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # torch normalises a bfloat16 / float16 input in float32 and rounds once: bit for bit x.float()'s result
        # rounded (tests/runtime/model/test_decode_ops.py), without the two casts
        return self.weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)


class GemmaRMSNorm(torch.nn.Module):
    """y = (x / sqrt(mean(x^2) + eps)) * (1 + weight), all in float32, then cast (transformers' Gemma3RMSNorm).

    The checkpoint stores weight as the offset from 1; the float32 (1 + weight) is kept as `scale`.
    """

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.scale = frozen(1.0 + weight.float())
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim], dtype of x; normalised over the last dimension."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.scale, self.eps)
        return (F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * self.scale).to(x.dtype)
