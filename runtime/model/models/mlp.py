"""The gated MLP of the dense families: down(act(gate(x)) * up(x)), gate and up fused into one matmul.

SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer") with act = SiLU for Llama, Qwen, Mistral and Phi-3;
GeGLU with the tanh approximation of GELU for Gemma 3. A family's MLP is built by an MlpBuilder, the slot a
mixture-of-experts block takes in the MoE families.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from runtime.model.hf_config import ModelConfig
from runtime.model.models.weights import WeightSource
from runtime.model.quant import Linear

# (cfg, weights, the MLP's name prefix e.g. "model.layers.3.mlp", layer index, quantization) -> module [T, hidden]
MlpBuilder = Callable[[ModelConfig, WeightSource, str, int, str], torch.nn.Module]


def _silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": _silu, "gelu_pytorch_tanh": _gelu_tanh}


class GatedMLP(torch.nn.Module):
    """down(act(gate(x)) * up(x)) from the fused gate_up weight [2 * inter, hidden] (gate rows first) and down
    [hidden, inter]; act is a key of ACTIVATIONS (ModelConfig.hidden_act)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: str, quantization: str = "none") -> None:
        super().__init__()
        self.inter = gate_up.shape[0] // 2
        self.gate_up_proj = Linear(gate_up, None, quantization)
        self.down_proj = Linear(down, None, quantization)
        self.act_name = act
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(self.act(gate) * up)


def dense_mlp(cfg: ModelConfig, src: WeightSource, prefix: str, layer: int, quantization: str) -> torch.nn.Module:
    """An MlpBuilder for separate gate_proj / up_proj / down_proj weights (Llama's names). Raises CorruptModelError
    when one is missing."""
    gate_up = torch.cat([src.take(f"{prefix}.gate_proj.weight"), src.take(f"{prefix}.up_proj.weight")])
    return GatedMLP(gate_up, src.take(f"{prefix}.down_proj.weight"), cfg.hidden_act, quantization)
