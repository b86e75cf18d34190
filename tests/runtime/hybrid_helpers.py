"""KV cache group test helpers: a tiny random Gemma 3 that repeats itself (vocab 512, tied embeddings, init std 0.1:
its greedy output falls into runs and returns to earlier tokens, so prompt lookup's drafts are partly accepted and
partly rejected), with local and global layers and a 16-token window, so short prompts and decodes cross it."""

from __future__ import annotations

from pathlib import Path

LOOPY_WINDOW = 16
SLIDING = "sliding_attention"
FULL = "full_attention"


def save_loopy_gemma3(folder: Path, tokenizer) -> Path:
    """Save the loopy tiny Gemma 3 (4 layers: local, local, global, local; hidden 64; 4 q heads, 2 KV heads of 16)
    into folder; returns folder."""
    from transformers import Gemma3TextConfig

    from tests.conftest import _save_tiny

    rope = {
        FULL: {"rope_type": "default", "rope_theta": 1_000_000.0},
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    }
    config = Gemma3TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        num_hidden_layers=4,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING],
        sliding_window=LOOPY_WINDOW,
        rope_parameters=rope,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config.architectures = ["Gemma3ForCausalLM"]
    return _save_tiny(folder, config, tokenizer, seed=3)
