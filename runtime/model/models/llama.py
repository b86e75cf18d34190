"""Llama (Llama 2/3, SmolLM2) and Qwen2: the shared decoder with every default.

Touvron et al. 2023 (Llama 2): pre-norm decoder with RMSNorm, rotary embeddings (default, linear or llama3 scaling),
grouped-query attention and a SwiGLU MLP. Qwen2 adds a bias to q/k/v, which separate_qkv reads when present; its
optional sliding window (use_sliding_window) is read by the config.
"""

from __future__ import annotations

from runtime.model.models.decoder import Family

LLAMA = Family()
