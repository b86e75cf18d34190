"""MoeConfig: the mixture-of-experts fields of a Hugging Face config.json (Qwen3-MoE, Mixtral), read without torch.

Keys (transformers 5.x configuration_qwen3_moe.py / configuration_mixtral.py): num_experts (Qwen3-MoE's Hub
configs; transformers 5 writes its alias num_local_experts, Mixtral's name), num_experts_per_tok (top-k),
moe_intermediate_size (Qwen3-MoE's expert width; Mixtral's experts use intermediate_size), norm_topk_prob (Qwen3-MoE;
Mixtral always renormalises), decoder_sparse_step and mlp_only_layers (Qwen3-MoE: which layers are sparse).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.model.errors import CorruptModelError

QWEN3_MOE = "Qwen3MoeForCausalLM"
MIXTRAL = "MixtralForCausalLM"
MOE_ARCHITECTURES = (QWEN3_MOE, MIXTRAL)


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MLP's shape and routing rule.

    num_experts: experts per sparse layer; top_k: experts each token runs (num_experts_per_tok);
    expert_intermediate_size: an expert's hidden width (elements); norm_topk_prob: the top-k probabilities are
    divided by their sum; sparse_step / mlp_only_layers: a layer i is sparse when i is not in mlp_only_layers and
    (i + 1) % sparse_step == 0 (transformers' Qwen3MoeDecoderLayer), the others run a dense MLP of
    ModelConfig.intermediate_size.
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        """True when layer `layer` (0-based) runs the experts, False when it runs a dense MLP."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0


def read_moe(raw: dict[str, Any], arch: str, path: Path) -> MoeConfig | None:
    """The MoeConfig of config.json `raw` for architecture `arch`, None for a dense architecture.

    Defaults are transformers' (Qwen3-MoE: 128 experts, top 8, width 768, no renormalisation; Mixtral: 8 experts,
    top 2, width intermediate_size, renormalised). Raises CorruptModelError when top-k is not in 1..num_experts or a
    size or step is not positive.
    """
    if arch not in MOE_ARCHITECTURES:
        return None
    qwen = arch == QWEN3_MOE
    experts = raw.get("num_experts", raw.get("num_local_experts", 128 if qwen else 8))
    width_key = "moe_intermediate_size" if qwen else "intermediate_size"
    moe = MoeConfig(
        num_experts=int(experts),
        top_k=int(raw.get("num_experts_per_tok", 8 if qwen else 2)),
        expert_intermediate_size=int(raw.get(width_key, 768 if qwen else 14336)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)) if qwen else True,
        sparse_step=int(raw.get("decoder_sparse_step", 1)) if qwen else 1,
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()) if qwen else (),
    )
    if not 1 <= moe.top_k <= moe.num_experts or moe.expert_intermediate_size < 1 or moe.sparse_step < 1:
        raise CorruptModelError(
            f"{path}: a mixture of experts needs 1 <= num_experts_per_tok <= num_experts and positive sizes; got "
            f"{moe.top_k} of {moe.num_experts} experts, width {moe.expert_intermediate_size}, step {moe.sparse_step}"
        )
    return moe
