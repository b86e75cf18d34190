"""Weight-only int8 (and, through runtime.model.quant_int4, int4) linears for steps of few rows on CPU, where reading
the weights bounds the step.

Scheme: per-output-channel symmetric ("absmax") int8, as in LLM.int8()'s vector-wise quantization (Dettmers et al.
2022, section 3.1) and gpt-fast's int8 weight-only handler: for each output row n of a weight W [N, K],
scale[n] = max_k |W[n, k]| / 127 and q[n, k] = round(W[n, k] / scale[n]) clamped to [-127, 127], so that
W ~= q * scale[:, None]. Activations stay in floating point; torch's `aten._weight_int8pack_mm(x, q, scale)` computes
(x @ q.T) * scale, reading 1 byte per weight instead of 2 (bfloat16) or 4 (float32).

Where it pays: on cold weights (each layer's projections read once per forward, so no cache holds them) the kernel
beats the dense matmul at few rows and loses at more; INT8_MAX_ROWS holds the crossing per activation dtype, measured
on cold SmolLM2-135M-shaped layers (the figures: README, "CPU speed"; the end-to-end effect:
benchmarks/decode_throughput.py).
- bfloat16 activations: the kernel works in blocks of 4 rows, and past one block it loses to bfloat16 F.linear.
- float32 activations: passed to the kernel as they are, it runs a scalar loop (slow), so float32 models convert
  them to bfloat16 around it (one copy each way) rather than refusing int8; their outputs keep the model dtype. The
  conversion moves the crossing to more rows than bfloat16's, on AVX-512 and AVX2 alike.
- The dense weight is kept beside the int8 copy: above the row limit F.linear on it beats the kernel, and
  dequantizing per call instead would cost a large share of each prefill. The cost is memory: the int8 copy adds one
  byte per weight (a bfloat16 model's linears take 1.5x their dense bytes).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels import cpu_qgemv
from runtime.model.cpu_features import cpu_flags
from runtime.model.quant_groups import (
    QGEMV_MAX_ROWS,
    dequantize,
    dequantize_bf16,
    group_fits,
    group_linear,
    quantize_q4,
    quantize_q8,
)
from runtime.model.quant_int4 import (
    INT4_MAX_ROWS,
    Int4Weight,
    dequantize_int4,
    int4_fits,
    int4_linear,
    pack_int4,
    quantize_int4,
)

QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "int4")
INT8_QMAX = 127
# The most rows (tokens) of a step that take the int8 kernel, per model (activation) dtype: where the kernel stopped
# beating F.linear when measured (the module docstring). float16 is not measured: it goes through bfloat16 as float32
# does, and is given bfloat16's limit.
INT8_MAX_ROWS: dict[torch.dtype, int] = {torch.bfloat16: 4, torch.float16: 4, torch.float32: 8}
# The kernel's x86 code (aten/src/ATen/native/cpu/int8mm_kernel.cpp, torch 2.x) has a vector path for bfloat16 only
# (float16 and float32 run a scalar loop there), steps through K 16 values at a time with no tail (AVX-512; 8 on
# AVX2), so K must be a multiple of 16, and loads the activations with aligned 32-byte loads, so their data must
# start 32-byte aligned: a misaligned view crashes the process (SIGSEGV) and another K reads past the rows.
KERNEL_DTYPE = torch.bfloat16
INT8_K_MULTIPLE = 16
_ALIGN = 64  # bytes; torch's CPU allocator aligns new tensors to 64


class Int8Weight(NamedTuple):
    """A weight quantized per output channel: qweight int8 [N, K], scales [N] in the kernel's activation dtype."""

    qweight: torch.Tensor
    scales: torch.Tensor


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> Int8Weight:
    """Per-output-channel symmetric int8 quantization of weight [N, K] (any float dtype).

    scales[n] = absmax(weight[n]) / 127, rounded to scale_dtype (the dtype the kernel multiplies in); q is computed
    against those rounded scales, q = clamp(round(weight / scales), -127, 127), so dequantize_int8 reproduces exactly
    what the kernel multiplies. A row of zeros gets scale 1 and q = 0. A weight whose rows are q * s with |q| <= 127,
    max |q| = 127 and s representable in scale_dtype round-trips exactly.
    Returns Int8Weight (new tensors on weight's device). Raises ValueError when weight is not 2-D.
    """
    if weight.dim() != 2:
        raise ValueError(f"quantize_int8 takes a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    w = weight.float()
    absmax = w.abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / INT8_QMAX, torch.ones_like(absmax)).to(scale_dtype)
    q = torch.round(w / scales.float()[:, None]).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return Int8Weight(q.contiguous(), scales.contiguous())


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """qweight int8 [N, K] * scales [N] -> [N, K] in dtype (computed in float32, then cast)."""
    return (qweight.float() * scales.float()[:, None]).to(dtype)


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(w).T (+ bias) -> [..., N] in x.dtype, through aten._weight_int8pack_mm.

    The kernel runs in KERNEL_DTYPE: x of another dtype (float32 models) is converted to it and the output, rounded
    to bfloat16 by the kernel, back to x.dtype; x is copied when it is not contiguous or not aligned as the kernel
    needs.
    Raises ValueError when K is not a multiple of INT8_K_MULTIPLE or w.scales is not KERNEL_DTYPE (the kernel would
    read past its rows); RuntimeError (from the kernel) on other shape mismatches.
    """
    k = x.shape[-1]
    if k % INT8_K_MULTIPLE or w.scales.dtype != KERNEL_DTYPE:
        raise ValueError(
            f"int8_linear needs K % {INT8_K_MULTIPLE} == 0 and {KERNEL_DTYPE} scales; got K={k}, "
            f"scales {w.scales.dtype}"
        )
    inner = x.reshape(-1, k).to(KERNEL_DTYPE).contiguous()
    if inner.data_ptr() % _ALIGN:
        inner = inner.clone()
    out = torch.ops.aten._weight_int8pack_mm(inner, w.qweight, w.scales)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


class Linear(torch.nn.Module):
    """y = x @ weight.T + bias, with optional int8 or int4 copies of weight for inputs of few rows.

    weight [N, K] (kept: it serves inputs above the row limits, and may be shared, e.g. a tied embedding); bias [N] or
    None. The copy for the fewest rows runs one of two kernels (attribute `kernel`):
    - "qgemv" (kernels.cpu_qgemv, the default: when enabled and built, K % 32 == 0, weight float32 or bfloat16): groups
      of 32 with float32 scales (runtime.model.quant_groups): int4 qweight uint8 [N, K / 2], scales and mins
      [N, K / 32] (quantize_q4: a GGUF 4-bit block's own grid); int8 qweight int8 [N, K], scales [N, K / 32]
      (quantize_q8); x is read in its own dtype; row limit QGEMV_MAX_ROWS for the CPU's ISA (where it beats torch's
      kernel; where that is 0, as on the scalar code, the op is not used). Beside it,
      torch's copy (torch_qweight, torch_scales) serves the rows above that limit up to torch's (torch_rows).
    - "torch" (otherwise): int8 per output channel, qweight int8 [N, K], scales [N] (KERNEL_DTYPE), kernel
      int8_linear; int4 qweight packed for this CPU, scales [K / 32, N, 2] (scale and zero per group), kernel
      runtime.model.quant_int4.int4_linear; row limits INT8_MAX_ROWS / INT4_MAX_ROWS.
    Buffers (not in the state dict: derived from weight at construction) are None when not built. forward sends inputs
    of at most max_rows rows (the kernel's limit for weight.dtype unless given) to the first copy, up to torch_rows to
    torch's copy beside the op's, larger ones to F.linear on the dense weight. A weight neither kernel can take (int8:
    K not a multiple of INT8_K_MULTIPLE; int4: K not a multiple of 32 or N of 16) stays dense only (qweight None,
    scheme "none"). Outputs keep x's dtype. Raises ValueError for an unknown quantization.
    """

    qweight: torch.Tensor | None
    scales: torch.Tensor | None
    mins: torch.Tensor | None
    torch_qweight: torch.Tensor | None
    torch_scales: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        quantization: str = "none",
        max_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, torch.nn.Parameter) else torch.nn.Parameter(weight, False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.register_buffer("qweight", None, persistent=False)
        self.register_buffer("scales", None, persistent=False)
        self.register_buffer("mins", None, persistent=False)
        self.register_buffer("torch_qweight", None, persistent=False)
        self.register_buffer("torch_scales", None, persistent=False)
        self.set_scheme(quantization, max_rows)

    def set_scheme(self, quantization: str, max_rows: int | None = None) -> None:
        """(Re)build the quantized copies of weight for `quantization` ("none", "int8" or "int4"); mutates qweight,
        scales, mins, torch_qweight, torch_scales, scheme, kernel, isa, max_rows and torch_rows (see the class
        docstring); builds the qgemv op on first use. Raises ValueError for an unknown quantization."""
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {quantization!r}; supported: {list(QUANTIZATIONS)}")
        self.kernel = "torch"
        self.isa = cpu_qgemv.isa_for(cpu_flags())
        w = self.weight.detach()
        torch_copy, torch_limits = _torch_copy(w, quantization)
        copy: tuple[torch.Tensor, ...] = torch_copy
        limits = torch_limits
        self.torch_qweight = None
        self.torch_scales = None
        self.torch_rows = 0
        if quantization != "none" and QGEMV_MAX_ROWS[self.isa][quantization].get(w.dtype, 0) and _qgemv_takes(w):
            self.kernel = "qgemv"
            limits = QGEMV_MAX_ROWS[self.isa][quantization]
            copy = tuple(quantize_q4(w) if quantization == "int4" else quantize_q8(w))
            if torch_copy and torch_limits.get(w.dtype, 0) > limits.get(w.dtype, 0):  # else the copy never runs
                self.torch_qweight = torch_copy[0]
                self.torch_scales = torch_copy[1]
                self.torch_rows = torch_limits.get(w.dtype, 0)
        self.qweight = copy[0] if copy else None
        self.scales = copy[1] if copy else None
        self.mins = copy[2] if len(copy) == 3 else None
        self.scheme = "none" if self.qweight is None else quantization
        if self.qweight is None:
            self.max_rows = 0
        elif max_rows is None:
            self.max_rows = limits.get(w.dtype, 0)
        else:
            self.max_rows = max_rows
        if self.kernel == "qgemv":
            self.max_rows = min(self.max_rows, cpu_qgemv.MAX_ROWS)

    def _torch_weight(self, scheme: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """torch's copy (qweight, scales) when its scheme is `scheme`: the first copy (kernel "torch") or the one
        beside the op's."""
        if self.scheme != scheme:
            return None
        if self.kernel == "torch" and self.qweight is not None and self.scales is not None:
            return self.qweight, self.scales
        if self.torch_qweight is not None and self.torch_scales is not None:
            return self.torch_qweight, self.torch_scales
        return None

    @property
    def int8(self) -> Int8Weight | None:
        """torch's int8 copy (qweight int8 [N, K], scales [N]), or None (not int8, or not built)."""
        copy = self._torch_weight("int8")
        return None if copy is None else Int8Weight(*copy)

    @property
    def int4(self) -> Int4Weight | None:
        """torch's int4 copy (qweight uint8 [N, K / 2], scales_and_zeros [K / 32, N, 2]), or None."""
        copy = self._torch_weight("int4")
        if copy is None:
            return None
        return Int4Weight(copy[0], copy[1], self.weight.shape[-1] // copy[1].shape[0])

    @property
    def groups(self) -> cpu_qgemv.Q4Weight | cpu_qgemv.Q8Weight | None:
        """The qgemv op's copy (Q4Weight under int4, Q8Weight under int8), or None when the op does not serve it."""
        if self.kernel != "qgemv" or self.qweight is None or self.scales is None:
            return None
        if self.mins is not None:
            return cpu_qgemv.Q4Weight(self.qweight, self.scales, self.mins)
        return cpu_qgemv.Q8Weight(self.qweight, self.scales)

    def dequantized(self, rows: int = 1) -> torch.Tensor:
        """What an input of `rows` rows is multiplied by: float32 [N, K], the dequantized copy that serves it (the
        op's, rounded to bfloat16 where the op's bfloat16 dot products serve those rows; or torch's), or weight
        itself when no copy does. Allocates; mutates nothing."""
        groups = self.groups
        if groups is not None and rows <= self.max_rows:
            bf16_dot = self.isa == "avx512_bf16" and rows >= 2 and self.weight.dtype == torch.bfloat16
            return dequantize_bf16(groups) if bf16_dot else dequantize(groups)
        if not self.uses_quantized(rows):
            return self.weight.detach().float()
        if self.int8 is not None:
            return dequantize_int8(self.int8.qweight, self.int8.scales)
        if self.int4 is not None:  # the packed layout depends on the CPU: quantize again (deterministic)
            return dequantize_int4(quantize_int4(self.weight.detach()))
        return self.weight.detach().float()

    def uses_quantized(self, rows: int) -> bool:
        """True when an input of `rows` rows (tokens) runs a quantized copy."""
        return self.qweight is not None and rows <= max(self.max_rows, self.torch_rows)

    def path(self, rows: int) -> str:
        """Which copy an input of `rows` rows runs: "qgemv" (the op's groups), "int4" or "int8" (torch's kernel on
        torch's copy), or "dense" (F.linear on weight). The one rule forward and the C++ decode layer
        (runtime/model/models/fused_layer.py) follow."""
        if rows and self.uses_quantized(rows):
            if self.groups is not None and rows <= self.max_rows:
                return "qgemv"
            if self.int4 is not None:
                return "int4"
            if self.int8 is not None:
                return "int8"
        return "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x.dtype; the op up to max_rows rows, torch's quantized kernel up to its limit,
        else F.linear (class docstring; the rule: path)."""
        path = self.path(x.numel() // x.shape[-1])
        if path == "qgemv":
            groups = self.groups
            assert groups is not None
            return group_linear(x, groups, self.isa, self.bias)
        if path == "int4":
            w4 = self.int4
            assert w4 is not None
            return int4_linear(x, w4, self.bias)
        if path == "int8":
            w8 = self.int8
            assert w8 is not None
            return int8_linear(x, w8, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        """in/out features, bias, and the quantized row limit and kernel when quantized."""
        n, k = self.weight.shape
        q = f", {self.scheme} ({self.kernel}) up to {self.max_rows} rows" if self.qweight is not None else ""
        q += f", torch's up to {self.torch_rows}" if self.torch_rows else ""
        return f"in_features={k}, out_features={n}, bias={self.bias is not None}{q}"


def _torch_copy(weight: torch.Tensor, quantization: str) -> tuple[tuple[torch.Tensor, ...], dict[torch.dtype, int]]:
    """torch's kernel's copy of weight [N, K] for `quantization` ((qweight, scales), or () when its kernel cannot take
    the shape) and that kernel's row limits."""
    if quantization == "int8" and weight.shape[-1] % INT8_K_MULTIPLE == 0:
        return tuple(quantize_int8(weight, KERNEL_DTYPE)), INT8_MAX_ROWS
    if quantization == "int4" and int4_fits(weight):
        return tuple(pack_int4(quantize_int4(weight))[:2]), INT4_MAX_ROWS
    return (), INT8_MAX_ROWS


def _qgemv_takes(weight: torch.Tensor) -> bool:
    """True when the qgemv op serves weight [N, K]: groups of 32 fit, float32 or bfloat16, the op is built."""
    return (
        group_fits(weight)
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.device.type == "cpu"
        and cpu_qgemv.load_op() is not None
    )
