"""Model implementations on kernels/ (paged KV). One class serves the whole supported Llama family."""

from __future__ import annotations

import torch

from runtime.config import InvalidConfig
from runtime.model.loader import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from runtime.model.models.batch import AttentionMetadata
from runtime.model.models.llama import LlamaForCausalLM
from runtime.model.quant_plan import QuantPlan

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "build_model"]

# Qwen2 differs only by its qkv bias and Mistral (full attention) not at all; both are read from the state dict.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES}


def build_model(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    max_positions: int,
    attention_backend: str | None = None,
    quantization: str | QuantPlan = "none",
) -> LlamaForCausalLM:
    """The model for cfg.architecture built from Hugging Face weights (emptied as they are taken).

    max_positions: tokens the rotary tables cover (the runner's max_model_len).
    quantization: a QuantPlan (runtime.model.quant_plan: each linear's scheme), or "none", "int8" or "int4" for every
    linear (ServerArgs.quantization without "auto", which needs the model folder: QuantPlan.for_folder): weight-only
    int8 copies of the linear layers, or int4 copies (groups of 32) with an int8 head, used for steps of few rows
    (runtime.model.quant, runtime.model.quant_int4); CPU weights only. Outputs keep the weights' dtype.
    Raises:
        UnsupportedModelError: an architecture without an implementation.
        CorruptModelError: a tensor the architecture needs is missing.
        InvalidConfig: an unknown quantization, or "int8" / "int4" with weights on a device other than the CPU.
    """
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise UnsupportedModelError(f"architecture {cfg.architecture!r}; supported: {sorted(MODEL_CLASSES)}")
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
    return cls(cfg, weights, max_positions, attention_backend, plan).eval()
