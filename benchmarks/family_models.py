"""Random-weight models of each supported architecture for the throughput benchmarks, saved as Hugging Face folders.

One shape for all (SmolLM2-135M's widths with 8 layers: hidden 576, 9 query heads and 3 K/V heads of 64, MLP 1536,
vocab 49152, with the embedded SmolLM2 tokenizer), so the rows differ only by what each family does: Qwen3's q/k
norms, Phi-3's fused projections, Mistral's 256-token window on every layer, Gemma 3's four (1 + w) norms per layer,
GeGLU and its local (256-token window) / global layers 5:1, and the two mixtures of experts in place of the MLP on
every layer: Qwen3-MoE (Qwen3's attention) and Mixtral (Mistral's, with its window), each with 8 experts of width
384 and top-2 routing (two experts a token: half the dense MLP's 1536). benchmarks/moe_decode.py gives their
tokens/s per number of active experts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = ("llama", "qwen3", "phi3", "mistral", "gemma3", "qwen3_moe", "mixtral")
WINDOW = 256
EXPERTS = 8
EXPERT_WIDTH = 384
TOP_K = 2


def _shape(small: bool) -> dict[str, Any]:
    return {
        "vocab_size": 49152,
        "hidden_size": 128 if small else 576,
        "intermediate_size": 256 if small else 1536,
        "num_hidden_layers": 2 if small else 8,
        "num_attention_heads": 2 if small else 9,
        "num_key_value_heads": 1 if small else 3,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def family_config(name: str, small: bool = False):
    """The transformers config of architecture `name` (one of ARCHITECTURES), with config.architectures set; small:
    2 layers of hidden 128 (2 query heads, 1 K/V head) for smoke runs. Raises ValueError for another name."""
    import transformers

    if name not in ARCHITECTURES:
        raise ValueError(f"architecture {name!r}; one of {ARCHITECTURES}")
    config_class, architecture, extra = _FAMILIES[name]
    fields = {**_shape(small), **extra}
    if name == "phi3":  # Phi3Config derives head_dim from hidden / heads (64 here too)
        fields.pop("head_dim")
    config = getattr(transformers, config_class)(**fields)
    config.architectures = [architecture]
    return config


_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": WINDOW, "query_pre_attn_scalar": 64}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": EXPERTS,
            "moe_intermediate_size": EXPERT_WIDTH,
            "num_experts_per_tok": TOP_K,
            "norm_topk_prob": True,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {
            "num_local_experts": EXPERTS,
            "intermediate_size": EXPERT_WIDTH,
            "num_experts_per_tok": TOP_K,
            "sliding_window": WINDOW,
        },
    ),
}


def save_family_model(name: str, folder: Path, seed: int = 0, small: bool = False) -> Path:
    """A random float32 model of architecture `name` (family_config(name, small)) and the embedded SmolLM2 tokenizer
    saved into folder; returns folder."""
    from transformers import AutoModelForCausalLM

    from runtime.model.loader import load_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name, small), dtype=torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)
    load_tokenizer("smollm2").save_pretrained(str(folder))
    return folder
