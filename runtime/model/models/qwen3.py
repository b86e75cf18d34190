"""Qwen3 (Qwen Team 2025, "Qwen3 Technical Report", section 2): Qwen2's decoder without the qkv bias and with an
RMSNorm over each head of q and of k (q_norm, k_norm, weights [head_dim]) before rotary.

Weight names: model.layers.N.self_attn.{q,k,v,o}_proj, .self_attn.{q,k}_norm, .mlp.{gate,up,down}_proj,
.input_layernorm, .post_attention_layernorm (Llama's). head_dim is given by the config (not hidden / heads).
"""

from __future__ import annotations

from runtime.model.models.decoder import Family

QWEN3 = Family(qk_norm=True)
