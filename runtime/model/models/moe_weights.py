"""The experts of a MoE layer taken from a Hugging Face checkpoint, in either of the two layouts it may hold.

- Per expert (the Hub's checkpoints, and what transformers 5.x's save_pretrained writes: it reverts its fused
  layout through the conversion mapping, conversion_mapping.py "qwen2_moe" / "mixtral"):
  Qwen3-MoE `model.layers.N.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight`, router `mlp.gate.weight`;
  Mixtral `model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.weight` (w1 gate, w3 up, w2 down), router
  `block_sparse_moe.gate.weight`.
- Fused, as transformers 5.x holds them in memory (Qwen3MoeExperts / MixtralExperts): `mlp.experts.gate_up_proj`
  [E, 2 * inter, hidden] (gate rows first) and `mlp.experts.down_proj` [E, hidden, inter], router `mlp.gate.weight`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from runtime.model.errors import CorruptModelError
from runtime.model.hf_config import ModelConfig
from runtime.model.models.mlp import GatedMLP
from runtime.model.models.moe import RouterRule, SparseMoeBlock
from runtime.model.models.weights import WeightSource


class ExpertNames(NamedTuple):
    """An expert's per-expert weight names under `<moe prefix>.experts.E.`: gate, up and down projections."""

    gate: str
    up: str
    down: str


QWEN_EXPERT_NAMES = ExpertNames("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ExpertNames("w1", "w3", "w2")


def take_experts(
    src: WeightSource, prefix: str, num_experts: int, names: ExpertNames
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per expert (gate_up [2 * inter, hidden] gate rows first, down [hidden, inter]) under `prefix` (e.g.
    "model.layers.3.mlp"), from the fused 3-D tensors when the checkpoint has them, else the per-expert ones.

    Raises CorruptModelError when a tensor is missing or the fused tensors do not hold num_experts experts.
    """
    fused = src.take_optional(f"{prefix}.experts.gate_up_proj")
    if fused is not None:
        down = src.take(f"{prefix}.experts.down_proj")
        if fused.shape[0] != num_experts or down.shape[0] != num_experts:
            raise CorruptModelError(
                f"{prefix}.experts holds {fused.shape[0]} / {down.shape[0]} experts; the config says {num_experts}"
            )
        return list(zip(fused.unbind(0), down.unbind(0), strict=True))
    experts = []
    for e in range(num_experts):
        base = f"{prefix}.experts.{e}"
        gate_up = torch.cat([src.take(f"{base}.{names.gate}.weight"), src.take(f"{base}.{names.up}.weight")])
        experts.append((gate_up, src.take(f"{base}.{names.down}.weight")))
    return experts


def sparse_moe_block(
    cfg: ModelConfig, src: WeightSource, prefix: str, names: ExpertNames, rule: RouterRule, quantization: str
) -> SparseMoeBlock:
    """The SparseMoeBlock under `prefix`: router `prefix.gate.weight` [E, hidden] and cfg.moe.num_experts experts
    (take_experts), each a GatedMLP of cfg.hidden_act quantized per `quantization`.

    Raises CorruptModelError (a tensor is missing), ValueError (cfg has no MoE section).
    """
    if cfg.moe is None:
        raise ValueError(f"{cfg.architecture} has no mixture-of-experts config")
    router = src.take(f"{prefix}.gate.weight")
    experts = [
        GatedMLP(gate_up, down, cfg.hidden_act, quantization)
        for gate_up, down in take_experts(src, prefix, cfg.moe.num_experts, names)
    ]
    return SparseMoeBlock(router, experts, cfg.moe.top_k, rule)
