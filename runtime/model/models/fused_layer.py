"""A decode step's decoder layer in one C++ call (kernels.cpu_decode_layer) where the op does what the layer does.

The op runs a dense layer of a quantized model (each projection a runtime.model.quant.Linear with a quantized copy)
for a step of one token per sequence; each projection runs the kernel its Linear would run for that many rows
(Linear.path: the qgemv op, torch's int4 / int8 kernel, or F.linear above their row limits). Anything else runs the
Python layer: a prefill or extend step, an unquantized model, a tensor-parallel (RowParallel) or mixture-of-experts
block, a partial rotary, Triton, a disabled or unbuilt op. The op's numerics are the Python layer's
(kernels/cpu_decode_layer.cpp's header).
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


class _Layer(NamedTuple):
    """What the op reads of a layer whatever the rows; the projections' tensors come per row count (_for_rows)."""

    linears: list[Linear]
    norms: list[torch.Tensor]
    norm_kind: str
    act: str


class FusedDecode:
    """Runs one DecoderLayer's decode steps through kernels.cpu_decode_layer when it can (module docstring).

    Holds the layer's parts; reads the projections when first called and again whenever one of them or its quantized
    copy was replaced (a quantization plan or tensor parallelism installed after construction), so the op never reads
    stale weights. The op's arguments are built once per row count and such change: O(1) Python per call otherwise.
    """

    def __init__(self, norms: LayerNorms, attention: Attention, mlp: torch.nn.Module) -> None:
        self.norms = norms
        self.attention = attention
        self.mlp = mlp
        self._key: tuple[int, ...] | None = None  # identities of the projections and their copies when read
        self._layer: _Layer | None = None  # None: the op does not run this layer
        self._by_rows: dict[int, cpu_decode_layer.LayerArgs] = {}

    def __call__(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor | None:
        """The layer's output [T, hidden] for x [T, hidden] from the op (K/V written into the caches), or None when
        the op does not run this step or layer (the caller runs the Python layer; nothing was written)."""
        if meta.max_query_len != 1 or x.device.type != "cpu":
            return None
        args = self._args(x.shape[0])
        if args is None:
            return None
        if x.dtype != k_cache.dtype or not (x.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
            return None
        if self.attention.sliding_window is not None and meta.window is not None:
            meta = meta.window
        return cpu_decode_layer.decode_layer(
            x, meta.positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, k_cache, v_cache, args
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

    def _args(self, rows: int) -> cpu_decode_layer.LayerArgs | None:
        projections = self._projections()
        key = tuple(id(p) for p in projections) + tuple(id(p._buffers.get("qweight")) for p in projections)
        if key != self._key:
            self._key = key
            self._layer = self._read(projections)
            self._by_rows = {}
        if self._layer is None:
            return None
        args = self._by_rows.get(rows)
        if args is None:
            args = cpu_decode_layer.op_args(self._for_rows(self._layer, rows))
            self._by_rows[rows] = args
        return args

    def _read(self, projections: list[torch.nn.Module]) -> _Layer | None:
        """The layer's parts the op reads, or None when the op does not run this layer."""
        attn = self.attention
        mlp = self.mlp
        linears = [p for p in projections if type(p) is Linear]
        if len(linears) != 4 or type(attn) is not Attention or not isinstance(mlp, GatedMLP):
            return None
        if attn.rotary.rotary_dim != attn.head_dim or attn.backend not in (None, "auto", "reference"):
            return None
        if not cpu_decode.ENABLED or attn.head_dim % 16 or attn.head_dim > cpu_decode.MAX_HEAD_DIM:
            return None
        if any(p.scheme == "none" for p in linears) or any(p.bias is not None for p in linears[1:]):
            return None
        kind = _norm_kind(self.norms, attn)
        if kind is None or mlp.act_name not in cpu_decode_layer.ACTIVATIONS or cpu_decode_layer.load_op() is None:
            return None
        norms = [_norm_tensor(n) for n in (*self.norms, attn.q_norm, attn.k_norm)]
        return _Layer(linears, norms, kind, mlp.act_name)

    def _for_rows(self, layer: _Layer, rows: int) -> cpu_decode_layer.LayerWeights:
        """The op's arguments for a step of `rows` rows: each projection's copy for that many rows (Linear.path)."""
        attn = self.attention
        tensors: list[torch.Tensor] = []
        kinds: list[str] = []
        group_sizes: list[int] = []
        for linear in layer.linears:
            kind, copy, group_size = _projection(linear, rows)
            tensors.extend(copy)
            kinds.append(kind)
            group_sizes.append(group_size)
        qkv_bias = layer.linears[0].bias
        return cpu_decode_layer.LayerWeights(
            norms=layer.norms,
            linears=tensors,
            kinds=kinds,
            group_sizes=group_sizes,
            qkv_bias=None if qkv_bias is None else qkv_bias.detach(),
            cos=attn.rotary.cos,
            sin_signed=attn.rotary.sin_signed,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            norm_kind=layer.norm_kind,
            act=layer.act,
            isa=layer.linears[0].isa,
            eps=_norm_eps(self.norms.pre_attention),
            scale=attn.scale,
            window=attn.sliding_window or 0,
        )


def _projection(linear: Linear, rows: int) -> tuple[str, tuple[torch.Tensor, ...], int]:
    """(kind, three tensors, group size) of kernels.cpu_decode_layer for the copy `linear` runs at `rows` rows."""
    path = linear.path(rows)
    groups = linear.groups
    int4 = linear.int4
    int8 = linear.int8
    if path == "qgemv" and isinstance(groups, Q4Weight):
        return "qgemv4", (groups.qweight, groups.scales, groups.mins), 0
    if path == "qgemv" and isinstance(groups, Q8Weight):
        return "qgemv8", (groups.qweight, groups.scales, groups.scales), 0
    if path == "int4" and int4 is not None:
        return "int4", (int4.qweight, int4.scales_and_zeros, _EMPTY), int4.group_size
    if path == "int8" and int8 is not None:
        return "int8", (int8.qweight, int8.scales, _EMPTY), 0
    return "dense", (linear.weight.detach(), _EMPTY, _EMPTY), 0


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
