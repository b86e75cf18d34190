"""Gemma 3 text models (Gemma Team 2025, "Gemma 3 Technical Report"; transformers' Gemma3ForCausalLM).

Against Llama's decoder: RMSNorm in Gemma's (1 + w) form everywhere, four norms per layer (input, post-attention on
the attention output, pre- and post-feedforward around the MLP), per-head q/k norms (the report's section 2.1, in
place of Gemma 2's attention softcapping), a GeGLU MLP with GELU's tanh approximation, embeddings multiplied by
sqrt(hidden) rounded to the model dtype, attention scale query_pre_attn_scalar^-1/2, tied embeddings. Local
sliding-window layers interleave with global ones (5:1; ModelConfig.layer_types), the local ones rotating with their
own base (rope_local_base_freq, 10k) and the global ones with rope_theta (1M) and the config's rope scaling; an
optional final logit softcap (ModelConfig.final_logit_softcapping).
"""

from __future__ import annotations

from runtime.model.models.decoder import Family, NormNames
from runtime.model.models.norms import GemmaRMSNorm

GEMMA3_NORMS = NormNames(
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"
)
GEMMA3 = Family(norm=GemmaRMSNorm, norm_names=GEMMA3_NORMS, qk_norm=True, scale_embeddings=True)
