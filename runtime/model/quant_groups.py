"""Group-wise weight quantization for the qgemv op (kernels/cpu_qgemv.py): 4-bit and 8-bit groups of 32 along K with
float32 scales, the form of GGUF's Q4_0 / Q4_1 / Q4_K and Q8_0 blocks, so a weight dequantized from such a file is
stored again on its own grid (no second rounding).

4 bits (quantize_q4): each group of 32 values w is written as q * d + m, q in 0..15, d and m float32. A GGUF 4-bit
block dequantizes to exactly that form: Q4_0 to (q - 8) * d, Q4_1 to q * d + m, and a Q4_K sub-block of 32 to
q * (d * sc) - dmin * mn (ggml-quants.c, dequantize_row_q4_K): one step and one offset per group. The grid is read
back from the values: with lo and hi the group's min and max, the step is d = (hi - lo) / c for a c in 1..15 (among
_grid_steps' candidates) that puts every value within GRID_TOLERANCE steps of lo + an integer number of steps; then
m = lo and q = round((w - lo) / d). A group on such a grid round-trips to float32 rounding (the codes the file used
need not reach 0 or 15, which is where min/max re-quantization adds a second rounding); a group on no grid (a float
checkpoint) gets c = 15, i.e. Q4_1's min/max quantizer (quantize_row_q4_1_ref).

8 bits (quantize_q8): Q8_0's absmax rule, d = max |w| / 127, q = round(w / d) in -127..127; a Q8_0 block (whose
largest value is +-127 d) round-trips to float32 rounding; wider types (Q5_x, Q6_K, floats) are rounded once to it.
"""

from __future__ import annotations

import torch

from kernels.cpu_qgemv import GROUP, Q4Weight, Q8Weight, pack_q4, qgemv, unpack_q4

Q4_LEVELS = 15  # q in 0..15
Q8_QMAX = 127
GRID_TOLERANCE = 1e-3  # in steps: float32 dequantization puts a value ~1e-6 steps off its grid point
_CHUNK = 1 << 16  # groups quantized at once (bounds the temporary memory to a few MB per candidate)


def group_fits(weight: torch.Tensor) -> bool:
    """True when weight [N, K] splits into groups of GROUP along K (K a positive multiple of 32)."""
    return weight.dim() == 2 and weight.shape[1] > 0 and weight.shape[1] % GROUP == 0


def _check(weight: torch.Tensor) -> None:
    if not group_fits(weight):
        raise ValueError(
            f"group quantization takes a 2-D weight [N, K] with K % {GROUP} == 0, got {tuple(weight.shape)}"
        )


def _grid_steps(groups: torch.Tensor) -> torch.Tensor:
    """For groups float32 [G, 32]: the number of steps c (1..15) between min and max of a grid holding every value,
    15 where none is found (or the group is constant). Candidates, in order: 15 (min and max on codes 0 and 15, as
    Q4_1's quantizer leaves them), then, for the groups that did not fit, round(k * span / gap) for k = 1, 2, 3, gap
    the distance from the minimum to the next value above it (k steps when the k - 1 codes above the minimum's are
    unused), and the same from the maximum down."""
    steps = torch.full((groups.shape[0],), Q4_LEVELS, dtype=torch.int64)
    rest = (~_fits(groups, torch.full((groups.shape[0],), float(Q4_LEVELS)))).nonzero()[:, 0]
    g = groups[rest]
    lo = g.amin(dim=1, keepdim=True)
    hi = g.amax(dim=1, keepdim=True)
    span = hi - lo
    floor = GRID_TOLERANCE * span
    offset = g - lo
    down = hi - g
    inf = torch.full_like(g, torch.inf)
    ratio_lo = span[:, 0] / torch.where(offset > floor, offset, inf).amin(dim=1)
    ratio_hi = span[:, 0] / torch.where(down > floor, down, inf).amin(dim=1)
    found = torch.zeros(g.shape[0], dtype=torch.bool)
    for ratio in (ratio_lo, ratio_hi, ratio_lo * 2, ratio_lo * 3):
        c = ratio.round().nan_to_num_(nan=Q4_LEVELS).clamp_(1, Q4_LEVELS)
        fits = _fits(g, c) & ~found
        steps[rest[fits]] = c[fits].long()
        found |= fits
    return steps


def _fits(groups: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """bool [G]: every value of groups [G, 32] within GRID_TOLERANCE steps of min + an integer multiple of
    (max - min) / steps[G] (true for a constant group)."""
    lo = groups.amin(dim=1, keepdim=True)
    span = groups.amax(dim=1, keepdim=True) - lo
    r = (groups - lo).mul_(steps[:, None] / torch.where(span > 0, span, torch.ones_like(span)))
    return (r.sub_(r.round()).abs_() <= GRID_TOLERANCE).all(dim=1)


def quantize_q4(weight: torch.Tensor) -> Q4Weight:
    """4-bit groups of weight [N, K] (any float dtype) on each group's own grid (the module docstring).

    Returns Q4Weight (new tensors): qweight uint8 [N, K / 2] (kernels.cpu_qgemv.pack_q4), scales d and mins m float32
    [N, K / 32]. Raises ValueError when weight is not 2-D with K % 32 == 0.
    """
    _check(weight)
    n, k = weight.shape
    groups = weight.detach().float().reshape(-1, GROUP)
    q = torch.empty(groups.shape, dtype=torch.uint8)
    scales = torch.empty(groups.shape[0])
    mins = torch.empty(groups.shape[0])
    for start in range(0, groups.shape[0], _CHUNK):
        g = groups[start : start + _CHUNK]
        lo = g.amin(dim=1)
        d = (g.amax(dim=1) - lo) / _grid_steps(g)
        safe = torch.where(d > 0, d, torch.ones_like(d))
        codes = torch.round((g - lo[:, None]) / safe[:, None]).clamp_(0, Q4_LEVELS)
        q[start : start + _CHUNK] = torch.where(d[:, None] > 0, codes, torch.zeros_like(codes)).to(torch.uint8)
        scales[start : start + _CHUNK] = d
        mins[start : start + _CHUNK] = lo
    return Q4Weight(pack_q4(q.reshape(n, k)), scales.reshape(n, k // GROUP), mins.reshape(n, k // GROUP))


def quantize_q8(weight: torch.Tensor) -> Q8Weight:
    """8-bit groups of weight [N, K] (any float dtype): d = absmax / 127 per group of 32 (1 for a group of zeros),
    q = clamp(round(w / d), -127, 127). Returns Q8Weight (new tensors: int8 [N, K], float32 [N, K / 32]). Raises
    ValueError when weight is not 2-D with K % 32 == 0."""
    _check(weight)
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // GROUP, GROUP)
    absmax = groups.abs().amax(dim=-1)
    scales = torch.where(absmax > 0, absmax / Q8_QMAX, torch.ones_like(absmax))
    q = torch.round(groups / scales[..., None]).clamp_(-Q8_QMAX, Q8_QMAX).to(torch.int8)
    return Q8Weight(q.reshape(n, k).contiguous(), scales.contiguous())


def dequantize(w: Q4Weight | Q8Weight) -> torch.Tensor:
    """What the op multiplies: float32 [N, K], q * scale (+ min for 4 bits) per group."""
    return _products(w, torch.float32)


def dequantize_bf16(w: Q4Weight | Q8Weight) -> torch.Tensor:
    """What the op multiplies bfloat16 x of 2 or more rows by on isa "avx512_bf16" (kernels/cpu_qgemv_bf16.cpp):
    float32 [N, K], q * scale (+ min) rounded once to float32 (the op's fma), then to bfloat16. Computed in float64,
    where a 4- or 8-bit q times a float32 scale is exact, and so is the sum with the min unless the two differ by
    more than a factor of about 2^20."""
    return _products(w, torch.float64).float().bfloat16().float()


def _products(w: Q4Weight | Q8Weight, dtype: torch.dtype) -> torch.Tensor:
    """q * scale (+ min for 4 bits) per group, computed in dtype: [N, K] of dtype."""
    q = unpack_q4(w.qweight) if isinstance(w, Q4Weight) else w.qweight
    n, k = q.shape
    out = q.to(dtype).reshape(n, k // GROUP, GROUP) * w.scales.to(dtype)[..., None]
    if isinstance(w, Q4Weight):
        out = out + w.mins.to(dtype)[..., None]
    return out.reshape(n, k)


# The most rows (tokens) of a step that take the qgemv op, by ISA (kernels.cpu_qgemv.isa_for), scheme and model
# (activation) dtype: the largest row count at which the op beat torch's int4pack / int8pack kernel on the cold SmolLM2
# shapes, one thread (benchmarks/qgemv.py, crossing["torch"]; figures in README, "Quantized decode GEMV"); above it
# Linear runs torch's kernel. On AVX-512 the op's int4 ties torch's at one row and loses from two (it is kept at one
# row for its accuracy and the file's own grid); on AVX2 torch's kernels are slower: measured again at 4-16 rows
# (torch held to AVX2, results/qgemv_avx2_rows.json), the op won up to 16 rows (int4) and 8 (int8) for float32 x,
# 8 and 12 for bfloat16.
# The scalar code is not faster than torch's: 0 (the op is not used). float16 models do not take the op (it reads
# float32 and bfloat16 x only). "avx512_bf16" (bfloat16 dot products from 2 rows of bfloat16 x): the op beat torch's
# int4 kernel at every row count to 16, and its int8 beat bfloat16 F.linear on the 49,152-row head up to 12 rows
# (torch's int8 kernel at none; README, "Batches of bfloat16 rows"); float32 x runs the avx512_vnni code.
QGEMV_MAX_ROWS: dict[str, dict[str, dict[torch.dtype, int]]] = {
    "avx512_bf16": {"int4": {torch.float32: 1, torch.bfloat16: 16}, "int8": {torch.float32: 1, torch.bfloat16: 12}},
    "avx512_vnni": {"int4": {torch.float32: 1, torch.bfloat16: 1}, "int8": {torch.float32: 1, torch.bfloat16: 2}},
    "avx2": {"int4": {torch.float32: 16, torch.bfloat16: 8}, "int8": {torch.float32: 8, torch.bfloat16: 12}},
    "scalar": {"int4": {}, "int8": {}},
}


def group_linear(x: torch.Tensor, w: Q4Weight | Q8Weight, isa: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(w).T (+ bias) -> [..., N] in x.dtype (float32 or bfloat16) through the qgemv op, for
    at most kernels.cpu_qgemv.MAX_ROWS rows; x is copied only when not contiguous. isa: kernels.cpu_qgemv.isa_for of
    the CPU. Raises KernelInputError (kernels.errors) on shapes the op does not take, RuntimeError when the op is not
    built (kernels.cpu_qgemv.load_op() is None)."""
    k = x.shape[-1]
    out = qgemv(x.reshape(-1, k).contiguous(), w, isa)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])
