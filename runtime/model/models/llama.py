"""A compact Llama-family decoder on paged KV (Llama 2/3, SmolLM2, Qwen2 with qkv bias, full-attention Mistral).

Touvron et al. 2023 (Llama 2): pre-norm decoder with RMSNorm (Zhang & Sennrich 2019), rotary embeddings, grouped-query
attention (Ainslie et al. 2023) and a SwiGLU MLP (Shazeer 2020). Attention reads and writes the paged KV cache through
kernels.store_kv and kernels.paged_attention; q/k/v and gate/up projections are fused into one matmul each. Every
projection and the head is a runtime.model.quant.Linear, its scheme from the QuantPlan (runtime.model.quant_plan): with
"int8" steps of few rows read int8 weights; with "int4" the projections read int4 (groups of 32) and the head int8
(an int4 head loses top-1 agreement: 0.845 vs float32 on the test text, against 0.96 with an int8 head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
from runtime.model.loader import CorruptModelError, ModelConfig
from runtime.model.models.batch import AttentionMetadata
from runtime.model.models.rotary import RotaryEmbedding
from runtime.model.quant import Linear
from runtime.model.quant_plan import NO_QUANTIZATION, QuantPlan

HEAD_NAMES = {False: "lm_head.weight", True: "model.embed_tokens.weight"}  # the head's weight, by tied or not


def _frozen(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


class WeightSource:
    """Hugging Face tensors by name; take() removes what it returns so the weights are held once."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def take(self, name: str) -> torch.Tensor:
        """Remove and return tensor `name`; raises CorruptModelError when the checkpoint lacks it."""
        if name not in self.weights:
            raise CorruptModelError(f"the checkpoint has no tensor {name!r}")
        return self.weights.pop(name)

    def take_optional(self, name: str) -> torch.Tensor | None:
        """Remove and return tensor `name`, or None when absent."""
        return self.weights.pop(name, None)


class RMSNorm(torch.nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 (as the Hugging Face Llama does)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = _frozen(weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], dtype of x."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class Attention(torch.nn.Module):
    """GQA self-attention over the paged KV cache: fused qkv projection, rotary, store_kv, paged_attention, o_proj."""

    def __init__(
        self,
        cfg: ModelConfig,
        src: WeightSource,
        prefix: str,
        rotary: RotaryEmbedding,
        backend: str | None,
        quantization: QuantPlan = NO_QUANTIZATION,
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        names = [f"{prefix}.{p}_proj" for p in "qkv"]
        qkv_weight = torch.cat([src.take(f"{n}.weight") for n in names])
        biases = [src.take_optional(f"{n}.bias") for n in names]
        present = [b for b in biases if b is not None]
        qkv_bias = torch.cat(present) if len(present) == len(biases) else None
        self.qkv_proj = Linear(qkv_weight, qkv_bias, quantization.scheme(*(f"{n}.weight" for n in names)))
        o_name = f"{prefix}.o_proj.weight"
        self.o_proj = Linear(src.take(o_name), None, quantization.scheme(o_name))
        self.rotary = rotary
        self.scale = self.head_dim**-0.5
        self.backend = backend

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. Writes this step's K/V into k_cache/v_cache [num_blocks, bs, kvh, d]."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = x.shape[0]
        q, k = self.rotary(
            meta.positions, q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        )
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend=self.backend)
        out = kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            backend=self.backend,
        )
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(torch.nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, src: WeightSource, prefix: str, quantization: QuantPlan = NO_QUANTIZATION) -> None:
        super().__init__()
        names = [f"{prefix}.{p}_proj.weight" for p in ("gate", "up", "down")]
        gate = src.take(names[0])
        up = src.take(names[1])
        self.inter = gate.shape[0]
        self.gate_up_proj = Linear(torch.cat([gate, up]), None, quantization.scheme(*names[:2]))
        self.down_proj = Linear(src.take(names[2]), None, quantization.scheme(names[2]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(torch.nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self,
        cfg: ModelConfig,
        src: WeightSource,
        prefix: str,
        rotary: RotaryEmbedding,
        backend: str | None,
        quantization: QuantPlan = NO_QUANTIZATION,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(src.take(f"{prefix}.input_layernorm.weight"), cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, src, f"{prefix}.self_attn", rotary, backend, quantization)
        self.post_attention_layernorm = RMSNorm(src.take(f"{prefix}.post_attention_layernorm.weight"), cfg.rms_norm_eps)
        self.mlp = MLP(src, f"{prefix}.mlp", quantization)

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this layer's K/V."""
        x = x + self.self_attn(self.input_layernorm(x), meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(torch.nn.Module):
    """The Llama-family causal LM over a flat varlen batch and a paged KV cache.

    Built from a Hugging Face state dict (names as in transformers' LlamaForCausalLM / Qwen2ForCausalLM /
    MistralForCausalLM); the dict is emptied as tensors are taken. Tied embeddings reuse embed_tokens for the head.
    quantization (runtime.model.quant_plan.QuantPlan) gives each projection and the head its scheme by the names of
    its weights: "int8" an int8 copy (runtime.model.quant.Linear) used for steps of few rows, "int4" int4 copies
    (groups of 32), the head never below int8. The embedding lookup keeps the dense table.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        max_positions: int,
        attention_backend: str | None = None,
        quantization: QuantPlan = NO_QUANTIZATION,
    ) -> None:
        super().__init__()
        src = WeightSource(weights)
        embed = src.take("model.embed_tokens.weight")
        self.config = cfg
        self.embed_weight = _frozen(embed)
        rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_type, cfg.rope_scaling, embed.dtype, embed.device
        )
        self.rotary = rotary
        self.layers = torch.nn.ModuleList(
            DecoderLayer(cfg, src, f"model.layers.{i}", rotary, attention_backend, quantization)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(src.take("model.norm.weight"), cfg.rms_norm_eps)
        head = src.take_optional("lm_head.weight")
        if head is None and not cfg.tie_word_embeddings:
            raise CorruptModelError("the checkpoint has no 'lm_head.weight' and its embeddings are not tied")
        tied = head is None or cfg.tie_word_embeddings
        head_weight = self.embed_weight if head is None or tied else _frozen(head)
        # The head stays int8 under "int4": its 49152 rows of logits lose too much at 4 bits (see the module doc).
        self.lm_head = Linear(head_weight, None, quantization.head_scheme(HEAD_NAMES[tied]))

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """Run one step and return float32 logits [len(meta.logits_indices) or T, vocab_size].

        input_ids: int64 [T]; k_cache, v_cache: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        (mutated: this step's K/V are written into their slots before attention reads them).
        """
        x = F.embedding(input_ids, self.embed_weight)
        for i, layer in enumerate(self.layers):
            x = layer(x, meta, k_cache[i], v_cache[i])
        if meta.logits_indices is not None:
            x = x.index_select(0, meta.logits_indices)
        return self.lm_head(self.norm(x)).float()
