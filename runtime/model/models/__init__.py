"""Model implementations on kernels/ (paged KV). One class serves the whole supported Llama family."""

from __future__ import annotations

import torch

from runtime.model.loader import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from runtime.model.models.batch import AttentionMetadata
from runtime.model.models.llama import LlamaForCausalLM

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "build_model"]

# Qwen2 differs only by its qkv bias and Mistral (full attention) not at all; both are read from the state dict.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES}


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int,
                attention_backend: str | None = None) -> LlamaForCausalLM:
    """The model for cfg.architecture built from Hugging Face weights (emptied as they are taken).

    max_positions: tokens the rotary tables cover (the runner's max_model_len).
    Raises:
        UnsupportedModelError: an architecture without an implementation.
        CorruptModelError: a tensor the architecture needs is missing.
    """
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise UnsupportedModelError(f"architecture {cfg.architecture!r}; supported: {sorted(MODEL_CLASSES)}")
    return cls(cfg, weights, max_positions, attention_backend).eval()
