"""Model implementations on kernels/ (paged KV): one shared decoder (decoder.py) and a Family per architecture."""

from __future__ import annotations

import torch

from runtime.config import InvalidConfig
from runtime.model.errors import UnsupportedModelError
from runtime.model.hf_config import SUPPORTED_ARCHITECTURES, ModelConfig
from runtime.model.models.batch import AttentionMetadata
from runtime.model.models.decoder import CausalLM, Family
from runtime.model.models.gemma3 import GEMMA3
from runtime.model.models.llama import LLAMA
from runtime.model.models.mistral import MISTRAL
from runtime.model.models.mixtral import MIXTRAL
from runtime.model.models.phi3 import PHI3
from runtime.model.models.qwen3 import QWEN3
from runtime.model.models.qwen3_moe import QWEN3_MOE
from runtime.model.quant_plan import AUTO, QuantPlan

__all__ = ["FAMILIES", "AttentionMetadata", "CausalLM", "build_model"]

# The registry: architecture (config.json's "architectures"[0]) -> its Family. Keys equal SUPPORTED_ARCHITECTURES.
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
    "MistralForCausalLM": MISTRAL,
    "Qwen3ForCausalLM": QWEN3,
    "Phi3ForCausalLM": PHI3,
    "Gemma3ForCausalLM": GEMMA3,
    "Qwen3MoeForCausalLM": QWEN3_MOE,
    "MixtralForCausalLM": MIXTRAL,
}
assert set(FAMILIES) == set(SUPPORTED_ARCHITECTURES), "the registry and the config reader disagree"


def build_model(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    max_positions: int,
    attention_backend: str | None = None,
    quantization: str | QuantPlan = "none",
) -> CausalLM:
    """The model for cfg.architecture built from Hugging Face weights (emptied as they are taken).

    max_positions: tokens the rotary tables cover (the runner's max_model_len).
    quantization: "none", "int8" or "int4" for every linear, or a QuantPlan (runtime.model.quant_plan; "auto" gives
    each linear its own scheme after the model is built, QuantPlan.apply): weight-only int8 copies of the linear
    layers, or int4 copies (groups of 32) with the head int8, used for steps of few rows (runtime.model.quant,
    runtime.model.quant_int4); CPU weights only. Outputs keep the weights' dtype.
    Raises:
        UnsupportedModelError: an architecture without an implementation (the message lists the supported ones).
        CorruptModelError: a tensor the architecture needs is missing.
        InvalidConfig: an unknown quantization, or "int8" / "int4" with weights on a device other than the CPU.
    """
    family = FAMILIES.get(cfg.architecture)
    if family is None:
        raise UnsupportedModelError(f"architecture {cfg.architecture!r}; supported: {sorted(FAMILIES)}")
    try:
        plan = quantization if isinstance(quantization, QuantPlan) else QuantPlan(quantization)
    except ValueError as e:
        raise InvalidConfig(str(e)) from e
    devices = {t.device.type for t in weights.values()}
    if plan.uses_kernels and devices - {"cpu"}:
        raise InvalidConfig(
            f"quantization {plan.quantization!r} runs on CPU only; the weights are on {sorted(devices)}: "
            "use quantization 'none' there"
        )
    uniform = "none" if plan.quantization == AUTO else plan.quantization
    model = CausalLM(family, cfg, weights, max_positions, attention_backend, uniform).eval()
    if plan.quantization == AUTO:
        plan.apply(model)
    return model
