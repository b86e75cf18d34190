"""The qgemv op (kernels/cpu_qgemv.cpp) on every ISA this CPU can run: the integer dot products exact to the bit, the
activation quantization equal to a torch reference of the same math, the error against the float product of the
dequantized weight within the bound the C++ header states, and clear errors for inputs it does not take. On
"avx512_bf16", bfloat16 x of 2 or more rows takes bfloat16 dot products (kernels/cpu_qgemv_bf16.cpp): exact on exact
inputs, x @ bf16(W).T up to float32 summation elsewhere; its float32 and one-row inputs give the avx512_vnni bits.

Run it natively and with the AVX2 code only (RADIXSERVE_CPU_FLAGS without avx512*/amx*, ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2): the ISAs under test are the ones the (possibly overridden) flags allow, so an AVX2-only
host never runs AVX-512 code.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_qgemv
from kernels.cpu_qgemv import GROUP, Q4Weight, Q8Weight, pack_q4, qgemv, unpack_q4
from kernels.errors import KernelInputError
from runtime.model.cpu_features import cpu_flags
from runtime.model.quant_groups import dequantize, dequantize_bf16
from tests.kernels.kernel_cases import random_weight

ORDER = ["scalar", "avx2", "avx512_vnni", "avx512_bf16"]
XQ_MAX = 32767  # x rounds to int16 per group (kernels/cpu_qgemv.cpp)
RUNNABLE = ORDER[: ORDER.index(cpu_qgemv.isa_for(cpu_flags())) + 1]  # every ISA up to the one the flags pick
INTEGER = [isa for isa in RUNNABLE if isa != "avx512_bf16"]  # the ISAs whose every input takes the integer math
BF16_DOT = pytest.mark.skipif(
    "avx512_bf16" not in RUNNABLE, reason="the CPU (or RADIXSERVE_CPU_FLAGS) lacks AVX512_BF16"
)
SHAPES = [
    (1, 48, 96),
    (3, 64, 64),
    (16, 40, 160),
    (5, 33, 32),
    (8, 24, 224),
]  # (M, N, K): odd and even group counts, 1..16 rows


@pytest.fixture(scope="module", autouse=True)
def _built():
    enabled = cpu_qgemv.ENABLED
    cpu_qgemv.ENABLED = True  # opt-in in the product (kernels/cpu_qgemv.py)
    assert cpu_qgemv.load_op() is not None, "the op must build on a test machine (a C++ compiler is required)"
    yield
    cpu_qgemv.ENABLED = enabled


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's activation rounding in torch: per row per group of 32, a = absmax / 32767, xq = round(x * (1 / a))
    -> xq float [M, G, 32] (integers), a [M, G], a * sum of xq [M, G]."""
    m, k = x.shape
    g = x.float().reshape(m, k // GROUP, GROUP)
    a = g.abs().amax(dim=-1) / XQ_MAX
    inv = torch.where(a > 0, 1 / a, torch.zeros_like(a))
    xq = torch.round(g * inv[..., None]).clamp(-XQ_MAX, XQ_MAX)
    return xq, a, a * xq.sum(dim=-1)


def reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """The op's math in float64: sum_g scale * a * (q . xq) (+ min * a * sum xq): float64 [M, N]."""
    xq, a, sums = quantize_x(x)
    n, k = q.shape
    dots = torch.einsum("mgj,ngj->mng", xq.double(), q.double().reshape(n, k // GROUP, GROUP))
    out = (dots * scales.double()[None] * a.double()[:, None]).sum(-1)
    if mins is not None:
        out += (mins.double()[None] * sums.double()[:, None]).sum(-1)
    return out


def dequantized(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    n, k = q.shape
    w = q.float().reshape(n, k // GROUP, GROUP) * scales[..., None]
    if mins is not None:
        w = w + mins[..., None]
    return w.reshape(n, k)


def test_pack_q4_puts_q_j_and_q_j_plus_16_in_one_byte():
    q = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 64)
    packed = pack_q4(q)
    assert packed.shape == (1, 32) and packed.dtype == torch.uint8
    assert packed[0, :16].tolist() == [j | (j << 4) for j in range(16)]  # q[j] = j and q[j + 16] = j
    assert torch.equal(unpack_q4(packed), q)
    with pytest.raises(ValueError, match=r"K % 32 == 0"):
        pack_q4(torch.zeros(2, 48, dtype=torch.uint8))


@pytest.mark.parametrize("isa", INTEGER)
@pytest.mark.parametrize("bits", [4, 8])
def test_integer_dot_products_are_exact(isa, bits):
    """Inputs whose float math is exact too (powers of two; integer x with each group's absmax 32767 * 2^-e at a
    channel whose weight code is 0, the rest within +-64, so that the terms and their sums stay far inside float32's
    24 bits): the op's output equals the float64 product to the bit, on every ISA; bfloat16 x gives the float32
    result of the same values rounded to bfloat16."""
    gen = torch.Generator().manual_seed(bits)
    for m, n, k in SHAPES:
        g = k // GROUP
        xi = torch.randint(-64, 65, (m, g, GROUP), generator=gen)
        xi[:, :, 5] = XQ_MAX * (1 - 2 * torch.randint(0, 2, (m, g), generator=gen))  # each group reaches +-32767
        x = (xi * torch.pow(2.0, -torch.randint(0, 3, (m, g, 1), generator=gen))).reshape(m, k)
        w, q = random_weight(bits, n, k, gen)
        q.reshape(n, g, GROUP)[:, :, 5] = 0 if bits == 8 else 8  # 4 bits: code 8 with min -8 * scale is w = 0
        scales = torch.pow(2.0, -torch.randint(0, 3, (n, g), generator=gen).float())
        mins = -8 * scales if bits == 4 else None  # w = (q - 8) * scale: Q4_0's form
        w = Q4Weight(pack_q4(q), scales, mins) if mins is not None else Q8Weight(q, scales)
        expect = x.double() @ dequantized(q, scales, mins).double().T
        assert torch.equal(reference(x, q, scales, mins), expect)  # x's rounding is exact on these inputs
        assert torch.equal(qgemv(x, w, isa), expect.float()), (isa, bits, m, n, k)
        x16 = torch.randn(m, k, generator=gen).bfloat16()
        got16 = qgemv(x16, w, isa)
        assert got16.dtype == torch.bfloat16 and torch.equal(got16, qgemv(x16.float(), w, isa).bfloat16())


@pytest.mark.parametrize("isa", INTEGER)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_inputs_match_the_quantized_math_and_the_stated_bound(isa, bits, dtype):
    """Random x with outlier channels: equal to the torch reference of the same rounded math up to float32 summation
    order, and within the bound of kernels/cpu_qgemv.cpp of the float product of the dequantized weight:
    |y - x @ W.T| <= sum_g a_g / 2 * sum_j |w_j| (+ float32 rounding of the terms)."""
    gen = torch.Generator().manual_seed(10 + bits)
    for m, n, k in SHAPES:
        x = torch.randn(m, k, generator=gen)
        x[:, 3] *= 40  # an outlier channel takes its group's range, as in a real model's activations
        x = x.to(dtype)
        w, q = random_weight(bits, n, k, gen)
        mins = w.mins if isinstance(w, Q4Weight) else None
        got = qgemv(x, w, isa).double()
        deq = dequantized(q, w.scales, mins).double()
        magnitude = x.double().abs() @ deq.abs().T  # sum_k |x_k w_k|: the scale of float32 summation error
        rounding = magnitude * 2**-20 + (1e-2 if dtype == torch.bfloat16 else 0) * reference(x, q, w.scales, mins).abs()
        assert ((got - reference(x, q, w.scales, mins)).abs() <= rounding).all(), (isa, m, n, k)
        bound = cpu_qgemv.rounding_bound(x, deq)
        err = (got - x.double() @ deq.T).abs()
        assert (err <= bound + rounding).all(), (isa, m, n, k, float((err - bound).max()))
        assert float(err.max()) > 0  # the bound is not vacuous: x's rounding does move the result


def exact_case(bits: int, m: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, Q4Weight | Q8Weight]:
    """bfloat16 x of small integers times powers of two and weights (q - 8) * 2^-e (4 bits) or q * 2^-e (8 bits, |q|
    <= 15): every weight, product and float32 partial sum is exact."""
    g = k // GROUP
    x = torch.randint(-16, 17, (m, k), generator=gen) * torch.pow(2.0, -torch.randint(0, 3, (m, 1), generator=gen))
    scales = torch.pow(2.0, -torch.randint(0, 3, (n, g), generator=gen).float())
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        return x.bfloat16(), Q4Weight(pack_q4(q), scales, -8 * scales)
    return x.bfloat16(), Q8Weight(torch.randint(-15, 16, (n, k), generator=gen, dtype=torch.int8), scales)


@BF16_DOT
@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_dot_products_are_exact_on_exact_inputs(bits):
    """bfloat16 x of 2..16 rows on "avx512_bf16": the float64 product rounded once to bfloat16, to the bit."""
    gen = torch.Generator().manual_seed(20 + bits)
    for m, n, k in [(2, 48, 96), (3, 64, 64), (16, 40, 160), (5, 33, 32), (8, 24, 224), (9, 17, 608), (12, 8, 64)]:
        x, w = exact_case(bits, m, n, k, gen)
        expect = x.double() @ dequantize_bf16(w).double().T
        assert torch.equal(dequantize_bf16(w), dequantize(w))  # these weights are bfloat16 values already
        got = qgemv(x, w, "avx512_bf16")
        assert got.dtype == torch.bfloat16 and torch.equal(got, expect.bfloat16()), (bits, m, n, k)


@BF16_DOT
@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_dot_products_are_x_times_the_bfloat16_weight(bits):
    """Random bfloat16 x of 2..16 rows with an outlier channel: y = x @ dequantize_bf16(W).T within float32 summation
    error (K * 2^-23 * sum_k |x_k w_k|) and y's own bfloat16 rounding (2^-8 relative); and one row (or float32 x)
    gives the avx512_vnni code's bits."""
    gen = torch.Generator().manual_seed(30 + bits)
    for m, n, k in SHAPES + [(2, 70, 576), (13, 50, 1536)]:
        x = torch.randn(m, k, generator=gen)
        x[:, 3] *= 40
        x = x.bfloat16()
        w, _ = random_weight(bits, n, k, gen)
        assert torch.equal(qgemv(x[:1], w, "avx512_bf16"), qgemv(x[:1], w, "avx512_vnni"))
        if m >= 2:
            got = qgemv(x, w, "avx512_bf16").double()
            wb = dequantize_bf16(w).double()
            ref = x.double() @ wb.T
            summation = k * 2**-23 * (x.double().abs() @ wb.abs().T)
            assert ((got - ref).abs() <= summation + ref.abs() * 2**-8).all(), (bits, m, n, k)
        assert torch.equal(qgemv(x.float(), w, "avx512_bf16"), qgemv(x.float(), w, "avx512_vnni"))


def test_result_does_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(3)
    w, _ = random_weight(4, 512, 256, gen)
    x = torch.randn(4, 256, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qgemv(x, w, RUNNABLE[-1])
        torch.set_num_threads(2)
        two = qgemv(x, w, RUNNABLE[-1])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_inputs_the_op_does_not_take_raise_kernel_input_errors():
    gen = torch.Generator().manual_seed(4)
    w, _ = random_weight(4, 16, 64, gen)
    w8, _ = random_weight(8, 16, 64, gen)
    isa = RUNNABLE[-1]
    with pytest.raises(KernelInputError, match=r"x has 17 rows; 1 to 16 are supported"):
        qgemv(torch.zeros(17, 64), w, isa)
    with pytest.raises(KernelInputError, match=r"x must be a contiguous float32 or bfloat16"):
        qgemv(torch.zeros(1, 64, dtype=torch.float16), w, isa)
    with pytest.raises(KernelInputError, match=r"qweight must be contiguous Byte \[N, 48\], got \[16, 32\]"):
        qgemv(torch.zeros(1, 96), w, isa)
    with pytest.raises(KernelInputError, match=r"K=48 is not a positive multiple of 32"):
        qgemv(torch.zeros(1, 48), w, isa)
    with pytest.raises(KernelInputError, match=r"scales and mins must be contiguous float32 \[N, K / 32\]"):
        qgemv(torch.zeros(1, 64), Q8Weight(w8.qweight, w8.scales.double()), isa)
    with pytest.raises(KernelInputError, match=r"isa 'neon'; supported"):
        qgemv(torch.zeros(1, 64), w, "neon")
    assert qgemv(torch.zeros(2, 64), Q8Weight(w8.qweight[:0], w8.scales[:0]), isa).shape == (2, 0)


def test_isa_follows_the_flags():
    assert cpu_qgemv.isa_for(frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})) == (
        "avx512_vnni"
    )
    assert cpu_qgemv.isa_for(
        frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"})
    ) == ("avx512_bf16")
    assert cpu_qgemv.isa_for(frozenset({"avx2", "fma", "avx512f", "avx512bw"})) == "avx2"  # no VNNI: AVX2 code
    assert cpu_qgemv.isa_for(frozenset({"sse4_2"})) == "scalar"
