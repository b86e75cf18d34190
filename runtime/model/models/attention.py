"""Self-attention over the paged KV cache, shared by every family: one fused qkv projection, optional per-head q/k
RMSNorm (Qwen3, Gemma 3), rotary, kernels.store_kv, kernels.paged_attention (causal, or over a sliding window), o_proj.

Grouped-query attention (Ainslie et al. 2023): num_heads query heads share num_kv_heads K/V heads.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

import kernels
from runtime.model.hf_config import ModelConfig
from runtime.model.models.batch import AttentionMetadata
from runtime.model.models.rotary import RotaryEmbedding
from runtime.model.models.weights import WeightSource
from runtime.model.quant import Linear


class QKV(NamedTuple):
    """The fused q/k/v projection: weight [(Hq + 2 Hk) * head_dim, hidden], rows q then k then v; bias or None."""

    weight: torch.Tensor
    bias: torch.Tensor | None


def separate_qkv(src: WeightSource, prefix: str) -> QKV:
    """q_proj, k_proj and v_proj of `prefix` (Llama's names) concatenated; their biases when all three have one.
    Raises CorruptModelError when a weight is missing."""
    names = [f"{prefix}.{p}_proj" for p in "qkv"]
    weight = torch.cat([src.take(f"{n}.weight") for n in names])
    biases = [src.take_optional(f"{n}.bias") for n in names]
    present = [b for b in biases if b is not None]
    return QKV(weight, torch.cat(present) if len(present) == len(biases) else None)


class Attention(torch.nn.Module):
    """GQA self-attention of one layer on the paged KV cache.

    qkv: the fused projection; q_norm / k_norm: per-head norms applied to q and k before rotary (None: none);
    scale: the softmax scale; sliding_window: tokens a query sees (itself included), None for full causal attention.
    The projections are runtime.model.quant.Linear (int8 / int4 copies under `quantization`).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        qkv: QKV,
        o_proj: torch.Tensor,
        rotary: RotaryEmbedding,
        scale: float,
        sliding_window: int | None,
        backend: str | None,
        quantization: str = "none",
        q_norm: torch.nn.Module | None = None,
        k_norm: torch.nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(qkv.weight, qkv.bias, quantization)
        self.o_proj = Linear(o_proj, None, quantization)
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.rotary = rotary
        self.scale = scale
        self.sliding_window = sliding_window
        self.backend = backend

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. Writes this step's K/V into k_cache/v_cache [num_blocks, bs, kvh, d] (a
        sliding layer's blocks are its KV cache group's when meta has a window part)."""
        if self.sliding_window is not None and meta.window is not None:
            meta = meta.window
        qkv = self.qkv_proj(x)
        t = x.shape[0]
        heads = self.num_heads + self.num_kv_heads
        if self.q_norm is not None and self.k_norm is not None:
            q = self.rotary(meta.positions, self.q_norm(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
            k = self.rotary(meta.positions, k)
        else:  # q and k heads side by side in qkv: rotated in one call
            qk = self.rotary(meta.positions, qkv[:, : self.q_size + self.kv_size].view(t, heads, self.head_dim))
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].reshape(t, self.num_kv_heads, self.head_dim)
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
            sliding_window=self.sliding_window,
        )
        return self.o_proj(out.reshape(t, self.q_size))
