"""One decoder layer of a decode step in one call (kernels/cpu_decode_layer.cpp): build on first use, load, call.

``torch.ops.radixserve_layer.decode_layer`` runs a dense pre-norm layer (runtime/model/models/decoder.py) for T rows
of one token each: norm, the qkv projection (+ bias), per-head q/k norms, rotary, store K/V at each row's slot, paged
decode attention, o_proj, the post-attention norm and residual, the pre-MLP norm, gate_up, act(gate) * up, down, the
post-MLP norm and residual. Each projection is the qgemv op (kernels/cpu_qgemv.py, group-quantized weights), torch's
int4 / int8 weight-only kernel or at::linear (KINDS), its attention the paged decode op (kernels/cpu_decode.py), all
called from C++; the two ops must be loaded first (load_op loads them). The C++ file's header gives the numerics:
Python's rounding points, kept.

Build: kernels.cpp_build compiles it on first use into ``$RADIXSERVE_CACHE/kernels``. A build or load failure logs one
warning and ``load_op`` returns None: the caller keeps the Python layer. ``RADIXSERVE_CPU_DECODE_LAYER=0`` (read at
import) turns it off. ``python -m kernels.cpu_decode_layer`` builds it (if needed) and prints where and how long.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from kernels import cpp_build, cpu_decode, cpu_qgemv
from kernels.errors import KernelInputError

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode_layer.cpp")
NAME = "radixserve_cpu_decode_layer"
# -ffp-contract=off: Python's x * cos + roll(x) * sin rounds each product and the sum; no fused multiply-add.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off")
OP = cpp_build.OpSource(NAME, (SOURCE,), CFLAGS)
ENABLED = os.environ.get("RADIXSERVE_CPU_DECODE_LAYER", "1") != "0"
NORM_KINDS = {"llama": 0, "gemma": 1}  # weight * round(norm(x)) in the model dtype; round(norm(x) * (1 + w)) in float32
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}
# A projection's kernel (the C++ file's LinearKind): the qgemv op on 4- or 8-bit groups, torch's int4 / int8
# weight-only kernels (runtime/model/quant_int4.py, quant.py), or F.linear.
KINDS = {"qgemv4": 0, "qgemv8": 1, "int4": 2, "int8": 3, "dense": 4}

_op: Callable[..., torch.Tensor] | None = None
_failed = False


class LayerWeights(NamedTuple):
    """What decode_layer reads of one layer besides the step's tensors.

    norms: six tensors, input, post-attention, pre-MLP, post-MLP, q, k; an absent one is an empty tensor. A "llama"
        norm is its weight in the model dtype [n]; a "gemma" one is its float32 scale 1 + weight [n].
    linears: qkv, o_proj, gate_up, down, three tensors each as its kind (a key of KINDS) reads them: qgemv4 / qgemv8
        (qweight, scales, mins) as kernels.cpu_qgemv takes them (8 bits: scales twice); int4 (qweight,
        scales_and_zeros, -) with its group size in group_sizes (0 for the others); int8 (qweight, scales, -); dense
        (weight, -, -); "-" an empty tensor.
    qkv_bias: [(num_heads + 2 num_kv_heads) head_dim] in the model dtype, or None.
    cos, sin_signed: the layer's RotaryEmbedding tables [max_positions, head_dim] in the model dtype.
    norm_kind, act: keys of NORM_KINDS and ACTIVATIONS; isa: a key of kernels.cpu_qgemv.ISAS; eps: the norms' epsilon;
    scale: the softmax scale; window: the layer's sliding window in tokens, 0 for full attention.
    """

    norms: Sequence[torch.Tensor]
    linears: Sequence[torch.Tensor]
    kinds: Sequence[str]
    group_sizes: Sequence[int]
    qkv_bias: torch.Tensor | None
    cos: torch.Tensor
    sin_signed: torch.Tensor
    num_heads: int
    num_kv_heads: int
    norm_kind: str
    act: str
    isa: str
    eps: float
    scale: float
    window: int


def load_op() -> Callable[..., torch.Tensor] | None:
    """torch.ops.radixserve_layer.decode_layer, building it (and loading the qgemv and paged decode ops it calls) on
    first use; None when ENABLED is False, when one of those two is unavailable, or (one warning per process) when it
    cannot be built or loaded."""
    global _op, _failed
    if not ENABLED or _failed:
        return _op
    if _op is not None:
        return _op
    if cpu_qgemv.load_op() is None or cpu_decode.load_op() is None:
        return None
    try:
        if not hasattr(torch.ops.radixserve_layer, "decode_layer"):
            OP.load()
        _op = torch.ops.radixserve_layer.decode_layer
    except Exception as exc:  # any build or load failure (compiler, linker, loader) keeps the Python layer
        detail = "\n".join(str(exc).strip().splitlines()[-6:])
        logger.warning("CPU decode layer op unavailable (%s); using the Python layer: %s", cpp_build.compiler(), detail)
        _failed = True
    return _op


class LayerArgs(NamedTuple):
    """LayerWeights as the op takes them (lists, and each key of NORM_KINDS, ACTIVATIONS, KINDS, ISAS as its int):
    built once per layer and row count by op_args, so a decode step converts nothing per layer."""

    cos: torch.Tensor
    sin_signed: torch.Tensor
    norms: list[torch.Tensor]
    linears: list[torch.Tensor]
    kinds: list[int]
    group_sizes: list[int]
    qkv_bias: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    window: int
    isa: int
    norm_kind: int
    act: int
    eps: float
    scale: float


def op_args(w: LayerWeights) -> LayerArgs:
    """w's arguments in the op's form. Raises KeyError for a kind, norm kind, activation or isa the op does not
    know."""
    return LayerArgs(
        w.cos,
        w.sin_signed,
        list(w.norms),
        list(w.linears),
        [KINDS[k] for k in w.kinds],
        list(w.group_sizes),
        w.qkv_bias,
        w.num_heads,
        w.num_kv_heads,
        w.window,
        cpu_qgemv.ISAS[w.isa],
        NORM_KINDS[w.norm_kind],
        ACTIVATIONS[w.act],
        w.eps,
        w.scale,
    )


def decode_layer(
    x: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    args: LayerArgs,
) -> torch.Tensor:
    """One decoder layer for x [T, hidden] (float32 or bfloat16, contiguous), row i sequence i's one token; args:
    op_args of the layer's LayerWeights.

    positions, slot_mapping: int64 [T] (slot -1: K/V not written); block_tables int32 [T, max_blocks], seq_lens int32
    [T] (this token included); k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] in x's dtype,
    contiguous: mutated (each row's K/V written at its slot). A qgemv projection takes at most
    kernels.cpu_qgemv.MAX_ROWS rows.
    Returns the layer's output [T, hidden], a new tensor in x's dtype.
    Raises KernelInputError for shapes, dtypes, positions or slots the op does not take (checked before any write;
    the block tables and seq_lens are checked by the attention after this step's K/V are stored, as in the Python
    layer); RuntimeError when the op is unavailable (check load_op() first).
    """
    op = _op if _op is not None else load_op()
    if op is None:
        raise RuntimeError("the decode layer op is unavailable (disabled or failed to build); check load_op() first")
    try:
        return op(x, positions, slot_mapping, block_tables, seq_lens, k_cache, v_cache, *args)
    except ValueError as exc:  # c10::ValueError from the operator's input checks (its own or the ops it calls)
        raise KernelInputError(str(exc).split("\n", 1)[0]) from exc


if __name__ == "__main__":
    OP.main()
