"""Tiny random-weight models of the dense families (Qwen3, Phi-3, Mistral, Gemma 3) built from their transformers
configs and saved with the SmolLM2 tokenizer (tests.conftest._save_tiny), and transformers' greedy reference on them.

Sizes: hidden 64, 2-4 layers, vocab 49152 (the tokenizer's). The sliding windows are 32-48 tokens, so prompts of
200+ tokens, chunked prefills and prefix-cache hits all cross them. Each config exercises its family's own parts:
Qwen3 a head_dim unlike hidden / heads (full attention); Phi-3 LongRoPE (long factors: contexts past
original_max_position_embeddings 64) over 3/4 of each head, and a 48-token window on every layer; Gemma 3 local and
global layers with their two rope bases (the global one linearly scaled), query_pre_attn_scalar unlike head_dim,
and a final logit softcap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.conftest import TINY_VOCAB, _save_tiny

WINDOW = 32
SLIDING = "sliding_attention"
FULL = "full_attention"


def _common() -> dict[str, Any]:
    return {
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "initializer_range": 0.25,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def tiny_config(family: str):
    """The transformers config of the tiny model of `family` ("qwen3", "phi3", "mistral", "gemma3")."""
    from transformers import Gemma3TextConfig, MistralConfig, Phi3Config, Qwen3Config

    if family == "qwen3":
        config = Qwen3Config(**_common(), num_hidden_layers=2, head_dim=32, max_position_embeddings=1024)
        config.architectures = ["Qwen3ForCausalLM"]
    elif family == "phi3":
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(6)],
            "long_factor": [1.0 + 0.5 * i for i in range(6)],
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 64,
        }
        config = Phi3Config(
            **_common(),
            num_hidden_layers=2,
            max_position_embeddings=1024,
            original_max_position_embeddings=64,
            rope_parameters=rope,
            sliding_window=48,
        )
        config.architectures = ["Phi3ForCausalLM"]
    elif family == "mistral":
        config = MistralConfig(**_common(), num_hidden_layers=2, sliding_window=WINDOW, max_position_embeddings=1024)
        config.architectures = ["MistralForCausalLM"]
    elif family == "gemma3":
        rope = {
            FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        }
        config = Gemma3TextConfig(
            **_common(),
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING],
            rope_parameters=rope,
            final_logit_softcapping=30.0,
            max_position_embeddings=1024,
        )
        config.architectures = ["Gemma3ForCausalLM"]
    else:
        raise ValueError(family)
    return config


def save_tiny_family(family: str, folder: Path, tokenizer, seed: int = 5) -> Path:
    """Save the tiny random model of `family` (float32 safetensors + tokenizer) into folder; returns folder."""
    return _save_tiny(folder, tiny_config(family), tokenizer, seed=seed)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """One prompt of random token ids (>= 3: no special token) per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy_each(folder: Path, prompts: list[list[int]], max_new_tokens: int):
    """transformers' float32 greedy generate of each prompt alone (no padding), EOS ignored: per prompt,
    (new token ids, float32 logits [max_new_tokens, vocab])."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    refs = []
    for p in prompts:
        out = hf.generate(
            torch.tensor([p]),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        refs.append((out.sequences[0, len(p) :].tolist(), torch.stack(out.logits, dim=1)[0].float()))
    return refs


def hf_beams(folder: Path, prompt: list[int], k: int, max_new_tokens: int) -> tuple[list[list[int]], list[float]]:
    """transformers' float32 beam search of prompt (num_beams = num_return_sequences = k, length_penalty 1,
    early stopping, exactly max_new_tokens tokens): (the k beams' new token ids, best first; their scores)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            length_penalty=1.0,
            early_stopping=True,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return [out.sequences[i, len(prompt) :].tolist() for i in range(k)], out.sequences_scores.tolist()
