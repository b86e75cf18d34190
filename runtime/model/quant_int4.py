"""Weight-only int4 linears, groups of 32 along K, for steps of few rows on CPU (runtime.model.quant.Linear uses them).

Scheme: asymmetric min/max per group, as ggml's Q4_1 (llama.cpp ggml-quants.c, quantize_row_q4_1_ref: d = (max -
min) / 15, m = min, q = round((w - m) / d) in [0, 15], w ~= q * d + m), written in the form torch's CPU kernel reads,
which is gpt-fast's and torchao's int4 weight-only layout: for a weight W [N, K] and group g of 32 consecutive k in
row n, scale = (max - min) / 15 and zero = min + 8 * scale, both rounded to bfloat16, and
q = clamp(round((W - zero) / scale) + 8, 0, 15) computed against the rounded values, so that
W ~= (q - 8) * scale + zero exactly as the kernel dequantizes (aten/src/ATen/native/cpu/int4mm_kernel.cpp, torch 2.x:
a lookup table maps q to q - 8, then fma with the group's scale and zero). A group whose values are all equal gets
scale 0 and q = 8, i.e. its value rounded to bfloat16. The embedded SmolLM2's layer weights were dequantized from a
Q4_1 GGUF with the same groups, so this reproduces them up to the bfloat16 rounding of scale and zero.

Kernel contract (torch 2.13, checked by running it): `aten._convert_weight_to_int4pack_for_cpu(q int32 [N, K], _)`
packs q (values 0..15) into uint8 [N, K / 2] in a layout chosen by the CPU capability at pack time (AVX-512, AVX2 or
scalar), so packed weights stay in the process that packed them; it needs N % 16 == 0 and K even (its second argument,
innerKTiles, is unused on CPU). `aten._weight_int4pack_mm_for_cpu(x [M, K], packed, g, scales_and_zeros [K / g, N, 2])`
needs x contiguous (any alignment), g in {32, 64, 128, 256}, K % g == 0 and scales_and_zeros in x's dtype; it returns
x @ W.T [M, N] in x's dtype, accumulated in float32 in blocks of 4 rows x 64 columns (AVX-512). Only bfloat16 has a
vector path there: float32 x runs a scalar loop, so float32 models convert around the kernel, as they do for int8.

Where it pays: as for int8 (runtime/model/quant.py), on cold weights the kernel beats the dense matmul at few rows
and loses at more; INT4_MAX_ROWS holds the crossing per activation dtype, measured on cold SmolLM2-135M-shaped layers
against bfloat16 F.linear and, for float32 models (activations converted to bfloat16 and back), against float32
F.linear with torch and oneDNN held to AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2), as float32 is the
default dtype of such CPUs (the figures: README, "CPU speed"). Above the limit the dense weight, kept beside the int4
copy, serves F.linear. The int4 copy adds half a byte per weight plus a bfloat16 scale and zero per group of 32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INT4_GROUP = 32  # values of K per scale / zero (Q4_1's block)
INT4_N_MULTIPLE = 16  # the packing works on blocks of 16 output rows
INT4_QMAX = 15
INT4_CENTER = 8  # the kernel dequantizes q as (q - 8) * scale + zero
# The most rows (tokens) of a step that take the int4 kernel, per model (activation) dtype: where the kernel stopped
# beating F.linear when measured (the module docstring). float16 is not measured: it goes through bfloat16 as float32
# does, and is given bfloat16's limit.
INT4_MAX_ROWS: dict[torch.dtype, int] = {torch.bfloat16: 12, torch.float16: 12, torch.float32: 16}
KERNEL_DTYPE = torch.bfloat16


class Int4Groups(NamedTuple):
    """Unpacked group-wise int4: q int32 [N, K] (0..15), scales and zeros [N, K / group] in the chosen dtype."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor


class Int4Weight(NamedTuple):
    """A weight packed for the kernel: qweight uint8 [N, K / 2], scales_and_zeros [K / group, N, 2] (KERNEL_DTYPE)."""

    qweight: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int


def int4_fits(weight: torch.Tensor, group_size: int = INT4_GROUP) -> bool:
    """True when the kernel can take weight [N, K]: K a multiple of group_size and N a multiple of INT4_N_MULTIPLE."""
    n, k = weight.shape
    return k % group_size == 0 and n % INT4_N_MULTIPLE == 0


def quantize_int4(
    weight: torch.Tensor, group_size: int = INT4_GROUP, scale_dtype: torch.dtype = KERNEL_DTYPE
) -> Int4Groups:
    """Asymmetric min/max int4 quantization of weight [N, K] (any float dtype) in groups of group_size along K.

    Per group: scale = (max - min) / 15 and zero = min + 8 * scale, rounded to scale_dtype (zero from the rounded
    scale); q = clamp(round((w - zero) / scale) + 8, 0, 15), or 8 where scale is 0, so that dequantize_int4 gives
    exactly what the kernel multiplies. Error per value: at most scale / 2 plus what the rounding of scale and zero
    moves the group's ends (|w - (q - 8) * scale - zero| <= scale / 2 + 8 * |scale - exact scale| + |zero - exact
    zero|). A weight whose groups are (q - 8) * s + z with q reaching 0 and 15 and s, z, s * 15 representable in
    scale_dtype round-trips exactly.
    Returns Int4Groups (new tensors). Raises ValueError when weight is not 2-D or K is not a multiple of group_size.
    """
    if weight.dim() != 2 or weight.shape[1] % group_size:
        raise ValueError(
            f"quantize_int4 takes a 2-D weight [N, K] with K % {group_size} == 0, got shape {tuple(weight.shape)}"
        )
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    lo = w.amin(dim=-1)
    hi = w.amax(dim=-1)
    scales = ((hi - lo) / INT4_QMAX).to(scale_dtype)
    zeros = (lo + INT4_CENTER * scales.float()).to(scale_dtype)
    s = scales.float()[..., None]
    z = zeros.float()[..., None]
    steps = torch.round((w - z) / torch.where(s > 0, s, torch.ones_like(s)))
    q = torch.where(s > 0, steps + INT4_CENTER, torch.full_like(steps, INT4_CENTER)).clamp_(0, INT4_QMAX)
    return Int4Groups(q.to(torch.int32).reshape(n, k), scales, zeros)


def dequantize_int4(groups: Int4Groups, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - 8) * scale + zero per group -> [N, K] in dtype (computed in float32, then cast)."""
    n, k = groups.q.shape
    g = k // groups.scales.shape[1]
    q = groups.q.float().reshape(n, k // g, g) - INT4_CENTER
    w = q * groups.scales.float()[..., None] + groups.zeros.float()[..., None]
    return w.reshape(n, k).to(dtype)


def pack_int4(groups: Int4Groups) -> Int4Weight:
    """Pack Int4Groups for aten._weight_int4pack_mm_for_cpu (layout of this CPU's capability; see the module doc).

    Scales and zeros are cast to KERNEL_DTYPE (exact for groups from quantize_int4's default). Raises RuntimeError
    (from torch) when N is not a multiple of 16.
    """
    n, k = groups.q.shape
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.q.contiguous(), 1)
    sz = torch.stack([groups.scales.t(), groups.zeros.t()], dim=-1).to(KERNEL_DTYPE).contiguous()
    return Int4Weight(packed, sz, k // groups.scales.shape[1])


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) -> [..., N] in x.dtype, W the dequantized int4 weight, via _weight_int4pack_mm_for_cpu.

    The kernel runs in KERNEL_DTYPE: x of another dtype (float32 models) is converted to it and the output, rounded
    to bfloat16 by the kernel, back to x.dtype. Raises RuntimeError (from the kernel) when K does not match the
    weight or is not a multiple of its group size.
    """
    k = x.shape[-1]
    inner = x.reshape(-1, k).to(KERNEL_DTYPE).contiguous()
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(inner, w.qweight, w.group_size, w.scales_and_zeros)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])
