"""Phi-3 / Phi-4-mini (Abdin et al. 2024, "Phi-3 Technical Report"): Llama's decoder with fused projections.

Weight names: model.layers.N.self_attn.qkv_proj (q, k, v rows in that order) and .mlp.gate_up_proj (gate rows
first), already in the fused layout the shared decoder runs. Its rope is default or LongRoPE ("longrope", older
configs "su" / "yarn": runtime.model.models.rotary), possibly over a fraction of each head (partial_rotary_factor);
a config's sliding_window applies to every layer (Phi-3-mini-4k: 2047).
"""

from __future__ import annotations

from runtime.model.hf_config import ModelConfig
from runtime.model.models.attention import QKV
from runtime.model.models.decoder import Family
from runtime.model.models.mlp import GatedMLP
from runtime.model.models.weights import WeightSource


def fused_qkv(src: WeightSource, prefix: str) -> QKV:
    """Phi-3's qkv_proj weight [(Hq + 2 Hk) * head_dim, hidden] (no bias). Raises CorruptModelError when missing."""
    return QKV(src.take(f"{prefix}.qkv_proj.weight"), src.take_optional(f"{prefix}.qkv_proj.bias"))


def fused_gate_up_mlp(cfg: ModelConfig, src: WeightSource, prefix: str, layer: int, quantization: str) -> GatedMLP:
    """The MlpBuilder of Phi-3: gate_up_proj [2 * inter, hidden] and down_proj. Raises CorruptModelError."""
    gate_up = src.take(f"{prefix}.gate_up_proj.weight")
    return GatedMLP(gate_up, src.take(f"{prefix}.down_proj.weight"), cfg.hidden_act, quantization)


PHI3 = Family(take_qkv=fused_qkv, build_mlp=fused_gate_up_mlp)
