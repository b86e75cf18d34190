"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"; transformers' MixtralForCausalLM): Mistral's decoder (its
sliding window on every layer when the config sets one) with a sparse MoE MLP on every layer. Routing: softmax, top-k
(2 of 8 in Mixtral-8x7B), always renormalised, the weights kept in float32 until each expert output is weighted
(runtime.model.models.moe). No shared expert.

Weight names: the Hub's model.layers.N.block_sparse_moe.gate.weight [E, hidden] and
block_sparse_moe.experts.E.{w1,w3,w2}.weight (gate, up, down); transformers 5.x's own names under .mlp.
(mlp.gate.weight, fused mlp.experts.{gate_up_proj,down_proj}) are read too (runtime.model.models.moe_weights).
"""

from __future__ import annotations

import torch

from runtime.model.hf_config import ModelConfig
from runtime.model.models.decoder import Family
from runtime.model.models.moe import RouterRule
from runtime.model.models.moe_weights import MIXTRAL_EXPERT_NAMES, sparse_moe_block
from runtime.model.models.weights import WeightSource

MIXTRAL_RULE = RouterRule(renormalize=True, weights_in_model_dtype=False)


def mixtral_moe(cfg: ModelConfig, src: WeightSource, prefix: str, layer: int, quantization: str) -> torch.nn.Module:
    """The MlpBuilder of Mixtral: the SparseMoeBlock of layer `layer`, under block_sparse_moe (the Hub's name) or
    under `prefix` (…mlp, transformers 5.x's). Raises CorruptModelError (a tensor is missing)."""
    hub_prefix = f"model.layers.{layer}.block_sparse_moe"
    moe_prefix = hub_prefix if f"{hub_prefix}.gate.weight" in src.weights else prefix
    return sparse_moe_block(cfg, src, moe_prefix, MIXTRAL_EXPERT_NAMES, MIXTRAL_RULE, quantization)


MIXTRAL = Family(build_mlp=mixtral_moe)
