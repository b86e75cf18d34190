"""Qwen3-MoE (Qwen Team 2025, "Qwen3 Technical Report", section 2.1; transformers' Qwen3MoeForCausalLM): Qwen3's
decoder (per-head q/k RMSNorm) with a sparse MoE MLP on the layers cfg.moe.is_sparse names (decoder_sparse_step,
mlp_only_layers) and a dense gated MLP of intermediate_size elsewhere. Routing: softmax, top-k, renormalised only
with norm_topk_prob, the weights cast to the model dtype (runtime.model.models.moe). No shared expert.

Weight names: Qwen3's attention and norms; sparse layers model.layers.N.mlp.gate.weight [E, hidden] and
mlp.experts.E.{gate_proj,up_proj,down_proj}.weight or the fused mlp.experts.{gate_up_proj,down_proj}
(runtime.model.models.moe_weights); dense layers mlp.{gate,up,down}_proj.weight.
"""

from __future__ import annotations

import torch

from runtime.model.hf_config import ModelConfig
from runtime.model.models.decoder import Family
from runtime.model.models.mlp import dense_mlp
from runtime.model.models.moe import RouterRule
from runtime.model.models.moe_weights import QWEN_EXPERT_NAMES, sparse_moe_block
from runtime.model.models.weights import WeightSource


def qwen3_moe_mlp(cfg: ModelConfig, src: WeightSource, prefix: str, layer: int, quantization: str) -> torch.nn.Module:
    """The MlpBuilder of Qwen3-MoE: a SparseMoeBlock on a sparse layer, a dense GatedMLP on the others.

    Raises CorruptModelError (a tensor is missing), ValueError (cfg has no MoE section).
    """
    if cfg.moe is None:
        raise ValueError(f"{cfg.architecture} has no mixture-of-experts config")
    if not cfg.moe.is_sparse(layer):
        return dense_mlp(cfg, src, prefix, layer, quantization)
    rule = RouterRule(renormalize=cfg.moe.norm_topk_prob, weights_in_model_dtype=True)
    return sparse_moe_block(cfg, src, prefix, QWEN_EXPERT_NAMES, rule, quantization)


QWEN3_MOE = Family(qk_norm=True, build_mlp=qwen3_moe_mlp)
