"""Tiny random-weight Qwen3-MoE and Mixtral models from their transformers configs (saved with the SmolLM2
tokenizer by tests.conftest._save_tiny, so in the per-expert layout save_pretrained writes).

Sizes: hidden 64, 8 experts of width 32, top 2, vocab 49152 (the tokenizer's). Qwen3-MoE: 3 layers, the middle one
dense (mlp_only_layers [1]), norm_topk_prob on (as Qwen3-30B-A3B), head_dim 32 unlike hidden / heads. Mixtral:
2 layers, a 48-token sliding window on every layer (Mixtral-8x7B has none; the window is there to be crossed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.conftest import TINY_VOCAB, _save_tiny

MOE_FAMILIES = ["qwen3_moe", "mixtral"]
NUM_EXPERTS = 8
TOP_K = 2


def _common() -> dict[str, Any]:
    return {
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": TOP_K,
        "initializer_range": 0.25,
        "max_position_embeddings": 1024,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def tiny_moe_config(family: str, **overrides: Any):
    """The transformers config of the tiny model of `family` ("qwen3_moe" or "mixtral"), with `overrides`."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    if family == "qwen3_moe":
        kw = {
            **_common(),
            "num_hidden_layers": 3,
            "head_dim": 32,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_experts": NUM_EXPERTS,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            **overrides,
        }
        config = Qwen3MoeConfig(**kw)
        config.architectures = ["Qwen3MoeForCausalLM"]
    elif family == "mixtral":
        kw = {
            **_common(),
            "num_hidden_layers": 2,
            "intermediate_size": 32,
            "num_local_experts": NUM_EXPERTS,
            "sliding_window": 48,
            **overrides,
        }
        config = MixtralConfig(**kw)
        config.architectures = ["MixtralForCausalLM"]
    else:
        raise ValueError(family)
    return config


def save_tiny_moe(family: str, folder: Path, tokenizer, seed: int = 5, **overrides: Any) -> Path:
    """Save the tiny random model of `family` (float32 safetensors + tokenizer) into folder; returns folder."""
    return _save_tiny(folder, tiny_moe_config(family, **overrides), tokenizer, seed=seed)
