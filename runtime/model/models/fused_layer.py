"""A decode step's decoder layer in one C++ call (kernels.cpu_decode_layer) where the op does what the layer does.

The op runs a dense layer whose four projections are the qgemv op's group-quantized copies (runtime.model.quant.Linear
with kernel "qgemv"), for a step of one token per sequence and at most as many rows as every projection sends to the
op. Anything else runs the Python layer: a prefill or extend step, more rows, an unquantized or torch-kernel
projection, a tensor-parallel (RowParallel) or mixture-of-experts block, a partial rotary, Triton, a disabled or
unbuilt op. The op's numerics are the Python layer's (kernels/cpu_decode_layer.cpp's header).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import cpu_decode, cpu_decode_layer
from kernels.cpu_qgemv import Q4Weight, Q8Weight
from runtime.model.models.attention import Attention
from runtime.model.models.batch import AttentionMetadata
from runtime.model.models.mlp import GatedMLP
from runtime.model.models.norms import GemmaRMSNorm, RMSNorm
from runtime.model.quant import Linear

NORM_KINDS: dict[type[torch.nn.Module], str] = {RMSNorm: "llama", GemmaRMSNorm: "gemma"}
_EMPTY = torch.empty(0)


class LayerNorms(NamedTuple):
    """A layer's norms: pre-attention, post-attention, pre-MLP, post-MLP (torch.nn.Identity where the family has
    none), each RMSNorm or GemmaRMSNorm."""

    pre_attention: torch.nn.Module
    post_attention: torch.nn.Module
    pre_mlp: torch.nn.Module
    post_mlp: torch.nn.Module


class _Built(NamedTuple):
    key: tuple[int, ...]  # identities of the projections and their quantized weights when built
    weights: cpu_decode_layer.LayerWeights | None  # None: the op does not run this layer
    max_rows: int  # the most rows every projection sends to the qgemv op


class FusedDecode:
    """Runs one DecoderLayer's decode steps through kernels.cpu_decode_layer when it can (module docstring).

    Holds the layer's parts; reads the projections when first called and again whenever one of them or its quantized
    copy was replaced (a quantization plan or tensor parallelism installed after construction), so the op never reads
    stale weights. The op's arguments are built once per such change: O(1) Python per call otherwise.
    """

    def __init__(self, norms: LayerNorms, attention: Attention, mlp: torch.nn.Module) -> None:
        self.norms = norms
        self.attention = attention
        self.mlp = mlp
        self._built: _Built | None = None

    def __call__(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor | None:
        """The layer's output [T, hidden] for x [T, hidden] from the op (K/V written into the caches), or None when
        the op does not run this step or layer (the caller runs the Python layer; nothing was written)."""
        if meta.max_query_len != 1 or x.device.type != "cpu":
            return None
        built = self._weights()
        if built.weights is None or x.shape[0] > built.max_rows:
            return None
        if x.dtype != k_cache.dtype or not (x.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
            return None
        if self.attention.sliding_window is not None and meta.window is not None:
            meta = meta.window
        return cpu_decode_layer.decode_layer(
            x, meta.positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, k_cache, v_cache, built.weights
        )

    def _projections(self) -> list[torch.nn.Module]:
        """qkv, o_proj, gate_up, down (read from the modules' registries: the cheapest lookup, once per call); empty
        when the MLP has no gate_up_proj (an MoE block)."""
        attn = self.attention._modules
        mlp = self.mlp._modules
        names = ("gate_up_proj", "down_proj")
        if not all(name in mlp for name in names):
            return []
        found = [attn.get("qkv_proj"), attn.get("o_proj"), mlp[names[0]], mlp[names[1]]]
        return [p for p in found if p is not None]

    def _weights(self) -> _Built:
        projections = self._projections()
        key = tuple(id(p) for p in projections) + tuple(id(p._buffers.get("qweight")) for p in projections)
        if self._built is None or self._built.key != key:
            self._built = _Built(key, *self._build(projections))
        return self._built

    def _build(self, projections: list[torch.nn.Module]) -> tuple[cpu_decode_layer.LayerWeights | None, int]:
        """The op's arguments and row limit, or (None, 0) when the op does not run this layer."""
        attn = self.attention
        mlp = self.mlp
        linears = [p for p in projections if type(p) is Linear]
        if len(linears) != 4 or type(attn) is not Attention or not isinstance(mlp, GatedMLP):
            return None, 0
        if attn.rotary.rotary_dim != attn.head_dim or attn.backend not in (None, "auto", "reference"):
            return None, 0
        if not cpu_decode.ENABLED or attn.head_dim % 16 or attn.head_dim > cpu_decode.MAX_HEAD_DIM:
            return None, 0
        groups = [p.groups for p in linears]
        if any(g is None for g in groups) or any(p.bias is not None for p in linears[1:]):
            return None, 0
        kind = _norm_kind(self.norms, attn)
        if kind is None or mlp.act_name not in cpu_decode_layer.ACTIVATIONS or cpu_decode_layer.load_op() is None:
            return None, 0
        tensors: list[torch.Tensor] = []
        bits: list[int] = []
        for g in groups:
            if isinstance(g, Q4Weight):
                tensors.extend((g.qweight, g.scales, g.mins))
                bits.append(4)
            elif isinstance(g, Q8Weight):
                tensors.extend((g.qweight, g.scales, g.scales))
                bits.append(8)
        qkv_bias = linears[0].bias
        weights = cpu_decode_layer.LayerWeights(
            norms=[_norm_tensor(n) for n in (*self.norms, attn.q_norm, attn.k_norm)],
            linears=tensors,
            bits=bits,
            qkv_bias=None if qkv_bias is None else qkv_bias.detach(),
            cos=attn.rotary.cos,
            sin_signed=attn.rotary.sin_signed,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            norm_kind=kind,
            act=mlp.act_name,
            isa=linears[0].isa,
            eps=_norm_eps(self.norms.pre_attention),
            scale=attn.scale,
            window=attn.sliding_window or 0,
        )
        return weights, min(p.max_rows for p in linears)


def _norm_kind(norms: LayerNorms, attn: Attention) -> str | None:
    """ "llama" or "gemma" when every norm of the layer (Identity aside) is of that one kind with one epsilon, else
    None."""
    present = [n for n in (*norms, attn.q_norm, attn.k_norm) if n is not None and type(n) is not torch.nn.Identity]
    kinds = {NORM_KINDS.get(type(n)) for n in present}
    if len(kinds) != 1 or None in kinds or len({n.eps for n in present}) != 1:
        return None
    if type(norms.pre_attention) is torch.nn.Identity or type(norms.pre_mlp) is torch.nn.Identity:
        return None
    if (attn.q_norm is None) != (attn.k_norm is None):
        return None
    return kinds.pop()


def _norm_eps(norm: torch.nn.Module) -> float:
    """A norm's epsilon (RMSNorm and GemmaRMSNorm keep it as eps; _norm_kind checked there is one)."""
    eps = norm.eps
    assert isinstance(eps, float)
    return eps


def _norm_tensor(norm: torch.nn.Module | None) -> torch.Tensor:
    """What the op reads of a norm: a Llama norm's weight, a Gemma norm's float32 scale, an empty tensor for none."""
    if isinstance(norm, GemmaRMSNorm):
        return norm.scale.detach()
    if isinstance(norm, RMSNorm):
        return norm.weight.detach()
    return _EMPTY
