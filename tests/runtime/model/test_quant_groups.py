"""Group quantization for the qgemv op (runtime/model/quant_groups.py) and Linear on it (runtime/model/quant.py):
GGUF 4-bit blocks (Q4_0, Q4_1, Q4_K sub-blocks) and Q8_0 blocks stored again on their own grid, off-grid weights
rounded once; a Linear on the op equals the float product of its dequantized weight within the op's bound, sends
more rows than its limit to torch's kernel (on torch's own copy) and more than torch's to the dense weight, and keeps
torch's kernels when the op is off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_qgemv
from kernels.cpu_qgemv import GROUP, Q4Weight, Q8Weight
from runtime.model.quant import INT8_MAX_ROWS, Linear, int8_linear
from runtime.model.quant_groups import QGEMV_MAX_ROWS, dequantize, dequantize_bf16, quantize_q4, quantize_q8
from runtime.model.quant_int4 import INT4_MAX_ROWS, dequantize_int4, int4_linear, quantize_int4

N, K = 48, 256


@pytest.fixture(autouse=True)
def _qgemv_on(monkeypatch):
    monkeypatch.setattr(cpu_qgemv, "ENABLED", True)  # the default, unless RADIXSERVE_CPU_QGEMV=0


G = K // GROUP


def gguf_4bit(kind: str, gen: torch.Generator) -> torch.Tensor:
    """A float32 weight [N, K] as a GGUF 4-bit file dequantizes to (ggml-quants.c dequantize_row_*): Q4_0 (q - 8) * d
    with d float16; Q4_1 q * d + m; Q4_K q * (d * sc) - dmin * mn with 6-bit sc, mn and codes that need not reach 0
    or 15 (3..12 here)."""
    low, high = (3, 13) if kind == "Q4_K" else (0, 16)
    q = torch.randint(low, high, (N, G, GROUP), generator=gen).float()
    d = (torch.rand(N, G, 1, generator=gen) * 0.05).half().float()
    if kind == "Q4_0":
        return ((q - 8) * d).reshape(N, K)
    if kind == "Q4_1":
        return (q * d + (torch.randn(N, G, 1, generator=gen) * 0.1).half().float()).reshape(N, K)
    sc = torch.randint(1, 64, (N, G, 1), generator=gen).float()
    mn = torch.randint(0, 64, (N, G, 1), generator=gen).float()
    dmin = (torch.rand(N, 1, 1, generator=gen) * 0.01).half().float()
    return (q * (d * sc) - dmin * mn).reshape(N, K)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_4bit_blocks_are_stored_on_their_own_grid(kind):
    """Round trip to float32 rounding (a millionth of a step), where the min/max re-quantization of the torch path
    moves Q4_K's values by up to half a step."""
    w = gguf_4bit(kind, torch.Generator().manual_seed(1))
    q4 = quantize_q4(w)
    assert q4.qweight.shape == (N, K // 2) and q4.scales.shape == (N, G) and q4.mins.shape == (N, G)
    step = q4.scales.repeat_interleave(GROUP, dim=1)
    assert float(((dequantize(q4) - w).abs() / step).max()) < 1e-4
    if kind == "Q4_K":
        minmax = dequantize_int4(quantize_int4(w, scale_dtype=torch.float32))
        assert float(((minmax - w).abs() / step).max()) > 0.1  # the second rounding the grid avoids


def test_off_grid_groups_get_min_max_quantization():
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(2))
    q4 = quantize_q4(w)
    groups = w.reshape(N, G, GROUP)
    span = groups.amax(-1) - groups.amin(-1)
    assert torch.allclose(q4.scales, span / 15) and torch.equal(q4.mins, groups.amin(-1))
    err = (dequantize(q4) - w).abs().reshape(N, G, GROUP).amax(-1)
    assert bool((err <= q4.scales / 2 * (1 + 1e-5) + 1e-7).all())
    constant = quantize_q4(torch.full((16, 64), 0.25))
    assert torch.equal(dequantize(constant), torch.full((16, 64), 0.25))


def test_q8_groups_round_trip_q8_0_blocks():
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (N, G, GROUP), generator=gen)
    q[:, :, 0] = 127
    d = (torch.rand(N, G, 1, generator=gen) * 0.01).half().float()
    w = (q * d).reshape(N, K)
    q8 = quantize_q8(w)
    assert q8.qweight.dtype == torch.int8 and q8.scales.shape == (N, G)
    assert torch.equal(q8.qweight.reshape(N, G, GROUP), q.to(torch.int8))
    assert float((dequantize(q8) - w).abs().max()) <= float(d.max()) * 1e-6
    zeros = quantize_q8(torch.zeros(16, 32))
    assert torch.equal(zeros.scales, torch.ones(16, 1)) and not zeros.qweight.any()
    with pytest.raises(ValueError, match=r"K % 32 == 0, got \(16, 48\)"):
        quantize_q8(torch.zeros(16, 48))


def op_bound(x: torch.Tensor, w: Q4Weight | Q8Weight) -> torch.Tensor:
    """kernels/cpu_qgemv.cpp's bound on |y - x @ dequantize(w).T|, float64 [M, N], plus float32 rounding."""
    deq = dequantize(w)
    return cpu_qgemv.rounding_bound(x, deq) + (x.double().abs() @ deq.double().abs().T) * 2**-20


@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_on_the_op_equals_the_dequantized_product_within_the_bound(quantization, dtype):
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(N, K, generator=gen) * 0.05).to(dtype)
    lin = Linear(weight, torch.randn(N, generator=gen).to(dtype), quantization)
    limit = QGEMV_MAX_ROWS[lin.isa][quantization][dtype]
    assert lin.kernel == "qgemv" and lin.scheme == quantization and lin.max_rows == limit
    torch_copy = lin.int4 if quantization == "int4" else lin.int8  # torch's copy serves the rows above the op's
    assert (lin.int8 if quantization == "int4" else lin.int4) is None
    torch_limit = (INT4_MAX_ROWS if quantization == "int4" else INT8_MAX_ROWS)[dtype]
    has_torch = torch_limit > limit  # AVX2's op reaches torch's int8 limit: no copy is kept then
    assert (torch_copy is not None) == has_torch and lin.torch_rows == (torch_limit if has_torch else 0)
    groups = lin.groups
    assert isinstance(groups, Q4Weight if quantization == "int4" else Q8Weight)
    assert groups.scales.dtype == torch.float32
    for rows in sorted({1, limit}):
        x = torch.randn(2, rows, K, generator=gen).to(dtype)[0]  # [rows, K]: the op reads x in its own dtype
        y = lin(x)
        assert y.dtype == dtype and y.shape == (rows, N)
        bf16_dot = lin.isa == "avx512_bf16" and rows >= 2 and dtype == torch.bfloat16  # kernels/cpu_qgemv_bf16.cpp
        assert torch.equal(lin.dequantized(rows), dequantize_bf16(groups) if bf16_dot else dequantize(groups))
        weights = lin.dequantized(rows).double()
        exact = x.double() @ weights.T + lin.bias.double()
        product = exact - lin.bias.double()
        # bfloat16: the op's output and the bias added to it are each rounded to 8 bits (half an ulp: 2^-9 relative)
        slack = 2**-8 * (product.abs() + exact.abs()) if dtype == torch.bfloat16 else 0
        # x's int16 rounding (the integer dot products), or float32 summation (the bfloat16 dot products)
        bound = K * 2**-23 * (x.double().abs() @ weights.abs().T) if bf16_dot else op_bound(x, groups)
        assert bool(((y.double() - exact).abs() <= bound + slack).all()), rows
    quantized_limit = max(limit, torch_limit)  # the most rows a quantized copy serves
    x = torch.randn(quantized_limit + 1, K, generator=gen).to(dtype)
    if has_torch:
        above = x[: limit + 1]  # torch's kernel: its output equals int4_linear / int8_linear's on its copy, bit for bit
        expect = (
            int4_linear(above, lin.int4, lin.bias) if lin.int4 is not None else int8_linear(above, lin.int8, lin.bias)
        )
        assert lin.uses_quantized(limit + 1) and torch.equal(lin(above), expect)
        assert not torch.equal(lin.dequantized(limit + 1), lin.dequantized(limit))
    lin.weight.data.zero_()  # the dense copy gives the bias alone: inputs above the quantized limits go there
    assert not lin.uses_quantized(quantized_limit + 1) and torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    assert lin.uses_quantized(quantized_limit) and not torch.equal(lin(x[:-1]), F.linear(x[:-1], lin.weight, lin.bias))


def test_linear_keeps_torch_kernels_when_the_op_is_off_or_cannot_take_the_weight(monkeypatch):
    float16 = Linear(torch.randn(32, 64, dtype=torch.float16), quantization="int8")  # the op reads float32/bf16
    assert float16.kernel == "torch" and float16.int8 is not None
    monkeypatch.setattr(cpu_qgemv, "ENABLED", False)
    lin = Linear(torch.randn(32, 64), quantization="int4")
    assert lin.kernel == "torch" and lin.groups is None and lin.int4 is not None and lin.mins is None
    expect = dequantize_int4(quantize_int4(lin.weight.detach()))
    assert torch.equal(lin.dequantized(), expect)


def test_isa_and_row_limit_follow_the_flags_at_construction(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CPU_FLAGS", "avx2 fma")
    lin = Linear(torch.randn(32, 64), quantization="int8")
    x = torch.randn(2, 64)
    assert lin.isa == "avx2" and lin.kernel == "qgemv" and lin.max_rows == QGEMV_MAX_ROWS["avx2"]["int8"][torch.float32]
    expect = x.double() @ lin.dequantized(2).double().T
    assert bool(((lin(x).double() - expect).abs() <= op_bound(x, lin.groups)).all())  # the AVX2 code ran
    monkeypatch.setenv("RADIXSERVE_CPU_FLAGS", "sse2")
    scalar = Linear(lin.weight.detach(), quantization="int8")  # the op's scalar code is no faster: torch's kernels
    assert scalar.isa == "scalar" and scalar.kernel == "torch" and scalar.groups is None and scalar.int8 is not None
