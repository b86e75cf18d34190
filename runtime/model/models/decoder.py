"""The decoder every dense family shares, and the Family record with which an architecture sets its variations.

A pre-norm decoder (Llama 2, Touvron et al. 2023): embeddings, layers of x + attn(norm(x)) then x + mlp(norm(x)),
a final norm and the LM head. What a family changes is data in its Family: its weight names (fused or separate
qkv and gate_up), the norm form (Llama's or Gemma's), Gemma's extra norms on the attention and MLP outputs, per-head
q/k norms, embeddings scaled by sqrt(hidden), and the MLP builder (the slot an MoE block takes). What a config
changes (ModelConfig): the layers' sliding windows, the local layers' rope base, the rotated fraction of a head, the
attention scale (query_pre_attn_scalar), the final logit softcap, the activation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from runtime.model.errors import CorruptModelError
from runtime.model.hf_config import ModelConfig
from runtime.model.models.attention import QKV, Attention, separate_qkv
from runtime.model.models.batch import AttentionMetadata
from runtime.model.models.fused_layer import FusedDecode, LayerNorms
from runtime.model.models.mlp import MlpBuilder, dense_mlp
from runtime.model.models.norms import RMSNorm
from runtime.model.models.rotary import RotaryEmbedding
from runtime.model.models.weights import WeightSource, frozen
from runtime.model.quant import Linear

NormFactory = Callable[[torch.Tensor, float], torch.nn.Module]  # (weight, eps) -> norm over the last dimension


class NormNames(NamedTuple):
    """A layer's norm names; None where the family has no such norm (the sublayer output is added as it is)."""

    pre_attention: str
    post_attention: str | None
    pre_mlp: str
    post_mlp: str | None


LLAMA_NORMS = NormNames("input_layernorm", None, "post_attention_layernorm", None)


@dataclass(frozen=True)
class Family:
    """What one architecture sets in the shared decoder (see the module docstring)."""

    take_qkv: Callable[[WeightSource, str], QKV] = separate_qkv
    build_mlp: MlpBuilder = dense_mlp
    norm: NormFactory = RMSNorm
    norm_names: NormNames = LLAMA_NORMS
    qk_norm: bool = False
    scale_embeddings: bool = False


class DecoderLayer(torch.nn.Module):
    """x + post_attn(attn(pre_attn(x))), then x + post_mlp(mlp(pre_mlp(x))); a missing post norm is the identity."""

    def __init__(
        self,
        family: Family,
        cfg: ModelConfig,
        src: WeightSource,
        layer: int,
        rotary: RotaryEmbedding,
        backend: str | None,
        quantization: str,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}"
        names = family.norm_names
        self.input_layernorm = family.norm(src.take(f"{prefix}.{names.pre_attention}.weight"), cfg.rms_norm_eps)
        self.self_attn = _attention(family, cfg, src, f"{prefix}.self_attn", layer, rotary, backend, quantization)
        self.post_attention_norm = _optional_norm(family, cfg, src, prefix, names.post_attention)
        self.pre_mlp_norm = family.norm(src.take(f"{prefix}.{names.pre_mlp}.weight"), cfg.rms_norm_eps)
        self.mlp = family.build_mlp(cfg, src, f"{prefix}.mlp", layer, quantization)
        self.post_mlp_norm = _optional_norm(family, cfg, src, prefix, names.post_mlp)
        norms = LayerNorms(self.input_layernorm, self.post_attention_norm, self.pre_mlp_norm, self.post_mlp_norm)
        self.fused_decode = FusedDecode(norms, self.self_attn, self.mlp)

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this layer's K/V. A decode step the C++ layer op can run goes
        there (runtime/model/models/fused_layer.py); the rest runs here."""
        fused = self.fused_decode(x, meta, k_cache, v_cache)
        if fused is not None:
            return fused
        x = x + self.post_attention_norm(self.self_attn(self.input_layernorm(x), meta, k_cache, v_cache))
        return x + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x)))


def _optional_norm(
    family: Family, cfg: ModelConfig, src: WeightSource, prefix: str, name: str | None
) -> torch.nn.Module:
    if name is None:
        return torch.nn.Identity()
    return family.norm(src.take(f"{prefix}.{name}.weight"), cfg.rms_norm_eps)


def _attention(
    family: Family,
    cfg: ModelConfig,
    src: WeightSource,
    prefix: str,
    layer: int,
    rotary: RotaryEmbedding,
    backend: str | None,
    quantization: str,
) -> Attention:
    q_norm = k_norm = None
    if family.qk_norm:
        q_norm = family.norm(src.take(f"{prefix}.q_norm.weight"), cfg.rms_norm_eps)
        k_norm = family.norm(src.take(f"{prefix}.k_norm.weight"), cfg.rms_norm_eps)
    scalar = cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.head_dim
    return Attention(
        cfg,
        family.take_qkv(src, prefix),
        src.take(f"{prefix}.o_proj.weight"),
        rotary,
        scalar**-0.5,
        cfg.layer_window(layer),
        backend,
        quantization,
        q_norm,
        k_norm,
    )


class TokenEmbedding(torch.nn.Module):
    """The embedding lookup: input_ids int64 [T] -> rows of weight [T, hidden] (weight shared with a tied head)."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class CausalLM(torch.nn.Module):
    """A decoder-only causal LM over a flat varlen batch and a paged KV cache, built from a Hugging Face state dict
    (emptied as tensors are taken) with the variations of `family`.

    Tied embeddings (or a checkpoint without lm_head.weight) reuse embed_tokens for the head. quantization "int8"
    gives every projection and the head an int8 copy (runtime.model.quant.Linear) used for steps of few rows; "int4"
    gives the projections int4 copies (groups of 32) and the head an int8 one (an int4 head loses top-1 agreement:
    0.845 vs float32 on SmolLM2's test text, against 0.96 with an int8 head). The embedding lookup keeps the dense
    table. Sliding layers with cfg.local_rope_theta get their own rotary tables.
    Raises CorruptModelError (a tensor is missing), ValueError (an unknown quantization).
    """

    embed_scale: torch.Tensor | None  # sqrt(hidden) in the model dtype (Gemma), a 0-d buffer; None: not scaled

    def __init__(
        self,
        family: Family,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        max_positions: int,
        attention_backend: str | None = None,
        quantization: str = "none",
    ) -> None:
        super().__init__()
        src = WeightSource(weights)
        embed = src.take("model.embed_tokens.weight")
        self.config = cfg
        self.embed_weight = frozen(embed)
        self.embed_tokens: torch.nn.Module = TokenEmbedding(self.embed_weight)  # a vocab-parallel one under TP
        # transformers' Gemma rounds sqrt(hidden) to the model dtype before it multiplies (bfloat16: 55.4256 -> 55.5)
        scale = None
        if family.scale_embeddings:
            scale = torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32).to(device=embed.device, dtype=embed.dtype)
        self.register_buffer("embed_scale", scale, persistent=False)
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.rotary = RotaryEmbedding(
            rotary_dim, max_positions, cfg.rope_theta, cfg.rope_type, cfg.rope_scaling, embed.dtype, embed.device
        )
        self.local_rotary = self.rotary
        if cfg.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(
                rotary_dim, max_positions, cfg.local_rope_theta, "default", {}, embed.dtype, embed.device
            )
        self.layers = torch.nn.ModuleList(
            DecoderLayer(family, cfg, src, i, self._rotary_of(i), attention_backend, quantization)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = family.norm(src.take("model.norm.weight"), cfg.rms_norm_eps)
        head = src.take_optional("lm_head.weight")
        if head is None and not cfg.tie_word_embeddings:
            raise CorruptModelError("the checkpoint has no 'lm_head.weight' and its embeddings are not tied")
        head_weight = self.embed_weight if head is None or cfg.tie_word_embeddings else frozen(head)
        # The head stays int8 under "int4": its rows of logits lose too much at 4 bits (see the class docstring).
        self.lm_head = Linear(head_weight, None, "int8" if quantization == "int4" else quantization)
        self.softcap = cfg.final_logit_softcapping

    def _rotary_of(self, layer: int) -> RotaryEmbedding:
        return self.local_rotary if self.config.layer_window(layer) is not None else self.rotary

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor | Sequence[torch.Tensor],
        v_cache: torch.Tensor | Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """Run one step and return float32 logits [len(meta.logits_indices) or T, vocab_size].

        input_ids: int64 [T]; k_cache, v_cache: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        (mutated: this step's K/V are written into their slots before attention reads them), or one
        [num_blocks, block_size, num_kv_heads, head_dim] tensor per layer (KV cache groups: runtime/model/hybrid_kv.py).
        """
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        for i, layer in enumerate(self.layers):
            x = layer(x, meta, k_cache[i], v_cache[i])
        if meta.logits_indices is not None:
            x = x.index_select(0, meta.logits_indices)
        logits = self.lm_head(self.norm(x))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()
