"""Weight-only int8 and int4 linears (runtime/model/quant.py, quant_int4.py): quantize / dequantize, torch's kernels
against the dequantized product, the row dispatch, and that a quantized model reads its quantized copies (through the
qgemv op where it builds; its own tests: test_quant_groups.py). The
quantized models' agreement with float32 on real text: test_quant_agreement.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_qgemv
from runtime.config import InvalidConfig, ServerArgs
from runtime.model.loader import load_config, resolve_model
from runtime.model.models import build_model
from runtime.model.quant import INT8_MAX_ROWS, Linear, dequantize_int8, int8_linear, quantize_int8
from runtime.model.quant_int4 import INT4_MAX_ROWS, Int4Groups, dequantize_int4, int4_linear, pack_int4, quantize_int4
from runtime.model.runner import ModelRunner
from tests.runtime.model.step_logits import teacher_forced_logits


@pytest.fixture
def torch_kernels(monkeypatch):
    """Linear on torch's int8pack / int4pack kernels: the qgemv op turned off (its tests: test_quant_groups.py)."""
    monkeypatch.setattr(cpu_qgemv, "ENABLED", False)


def test_quantize_round_trips_representable_weights_exactly():
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (6, 40), dtype=torch.int8)
    q[:, 7] = torch.tensor([127, -127, 127, -127, 127, -127], dtype=torch.int8)  # each row reaches the absmax
    # scales exact in bfloat16; q * scale exact in float32 for all, and in bfloat16 (8 significant bits) for the powers
    # of two
    for dtype, scales in (
        (torch.float32, [2.0**-7, 2.0**-3, 3 * 2.0**-8, 1.0, 5 * 2.0**-12, 2.0**4]),
        (torch.bfloat16, [2.0**-7, 2.0**-3, 2.0**-8, 1.0, 2.0**-12, 2.0**4]),
    ):
        s = torch.tensor(scales)
        weight = (q.float() * s[:, None]).to(dtype)
        assert torch.equal(weight.float(), q.float() * s[:, None])
        got = quantize_int8(weight)
        assert got.qweight.dtype == torch.int8 and got.scales.dtype == torch.bfloat16
        assert torch.equal(got.qweight, q)
        assert torch.equal(got.scales.float(), s)
        assert torch.equal(dequantize_int8(got.qweight, got.scales, dtype), weight)
        got32 = quantize_int8(weight, scale_dtype=torch.float32)
        assert got32.scales.dtype == torch.float32 and torch.equal(got32.qweight, q)


def test_quantize_scales_are_row_absmax_over_127_and_errors_half_a_step():
    torch.manual_seed(1)
    weight = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]
    weight[5] = 0.0
    got = quantize_int8(weight)
    absmax = weight.abs().amax(dim=1)
    expect = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax)).to(torch.bfloat16)
    assert torch.equal(got.scales, expect)  # the same float32 ops, then one rounding: bit for bit
    assert got.scales[5] == 1.0 and int(got.qweight[5].abs().max()) == 0
    assert int(got.qweight.abs().amax(dim=1)[absmax > 0].min()) >= 126  # the bfloat16 scale moves the top by <= 1
    err = (weight - dequantize_int8(got.qweight, got.scales)).abs()
    assert bool((err <= got.scales.float()[:, None] * 0.5 * (1 + 1e-6)).all())
    with pytest.raises(ValueError, match=r"2-D weight \[N, K\], got shape \(4,\)"):
        quantize_int8(torch.ones(4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_linear_equals_the_dense_product_of_the_dequantized_weight(dtype):
    torch.manual_seed(2)
    w = quantize_int8(torch.randn(48, 32) * 0.1)
    x = torch.randn(3, 32).to(dtype)
    bias = torch.randn(48).to(dtype)
    got = int8_linear(x, w, bias)
    assert got.dtype == dtype and got.shape == (3, 48)
    ref = F.linear(x.to(torch.bfloat16).double(), dequantize_int8(w.qweight, w.scales, torch.float64)) + bias.double()
    assert float((got.double() - ref).abs().max()) <= 0.02 * float(ref.abs().max())
    assert int8_linear(x[:0], w).shape == (0, 48)
    # a view starting 16 bytes into its storage: the kernel's aligned loads would crash on it; int8_linear copies it
    flat = torch.zeros(8 + 3 * 32, dtype=dtype)
    flat[8:] = x.flatten()
    assert torch.equal(int8_linear(flat[8:].view(3, 32), w, bias), got)
    with pytest.raises(ValueError, match=r"K % 16 == 0 and torch.bfloat16 scales; got K=24, scales torch.bfloat16"):
        int8_linear(torch.ones(1, 24), quantize_int8(torch.ones(4, 24)))


def test_linear_sends_up_to_max_rows_to_the_int8_copy_and_more_to_the_dense_weight(torch_kernels):
    assert INT8_MAX_ROWS[torch.bfloat16] == 4 and INT8_MAX_ROWS[torch.float32] == 8
    torch.manual_seed(3)
    for dtype, limit in ((torch.bfloat16, 4), (torch.float32, 8)):
        lin = Linear(torch.randn(16, 32).to(dtype), quantization="int8")
        assert (
            lin.scheme == "int8"
            and lin.max_rows == limit
            and lin.scales is not None
            and lin.scales.dtype == torch.bfloat16
        )
        lin.weight.data.zero_()  # the dense copy now gives zeros: a nonzero output came from the int8 copy
        for rows in range(1, limit + 3):
            y = lin(torch.ones(rows, 32, dtype=dtype))
            assert y.dtype == dtype and y.shape == (rows, 16)
            assert lin.uses_quantized(rows) == (rows <= limit) == bool(y.abs().sum() > 0), (dtype, rows)
    dense = Linear(torch.randn(16, 24), torch.randn(16))
    assert dense.qweight is None and dense.scales is None and dense.scheme == "none" and not dense.uses_quantized(1)
    assert torch.equal(dense(torch.ones(2, 24)), F.linear(torch.ones(2, 24), dense.weight, dense.bias))
    int8_copy = Linear(torch.randn(16, 32), quantization="int8").int8
    assert int8_copy is not None and int8_copy.qweight.nbytes + int8_copy.scales.nbytes == 16 * 32 + 16 * 2
    odd = Linear(torch.randn(16, 24), quantization="int8")  # K not a multiple of 16: the kernel cannot take it
    assert (
        odd.qweight is None
        and not odd.uses_quantized(1)
        and torch.equal(odd(torch.ones(1, 24)), F.linear(torch.ones(1, 24), odd.weight))
    )
    with pytest.raises(ValueError, match=r"quantization 'int2'; supported: \['none', 'int8', 'int4'\]"):
        Linear(torch.randn(4, 4), quantization="int2")


def test_build_model_refuses_unknown_quantization_and_non_cpu_weights():
    cfg = load_config(resolve_model("smollm2"))
    with pytest.raises(InvalidConfig, match=r"^quantization 'int2'; supported: \['auto', 'none', 'int8', 'int4'\]$"):
        build_model(cfg, {}, 64, quantization="int2")
    for q in ("int8", "int4"):
        with pytest.raises(InvalidConfig, match=rf"^quantization '{q}' runs on CPU only; the weights are on \['meta"):
            build_model(cfg, {"x": torch.empty(2, device="meta")}, 64, quantization=q)


def test_server_args_quantization_reaches_the_model(tiny_qwen2_dir):
    runner = ModelRunner(ServerArgs(model=str(tiny_qwen2_dir), num_blocks=16, dtype="float32", quantization="int8"))
    model = runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4 + 1 and all(m.qweight is not None for m in linears)
    assert model.layers[0].self_attn.qkv_proj.bias is not None  # Qwen2's qkv bias rides along
    assert model.lm_head.weight is model.embed_weight  # tied: the head's dense weight is the embedding table
    logits = teacher_forced_logits(runner, [[1, 2, 3, 4, 5]])[0]
    assert logits.shape == (4, 49152) and logits.dtype == torch.float32 and bool(logits.isfinite().all())


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_steps_of_few_rows_never_read_the_dense_weights(tiny_llama_dir, quantization):
    runner = ModelRunner(
        ServerArgs(model=str(tiny_llama_dir), num_blocks=16, dtype="float32", quantization=quantization)
    )
    layer = runner.model.layers[0]
    schemes = [
        m.scheme
        for m in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
            runner.model.lm_head,
        )
    ]
    assert schemes == [quantization] * 4 + ["int8"]  # under int4 the head stays int8
    segments = [[5, 9, 2, 7, 11, 3, 8, 4], [6, 1, 12, 10, 13]]  # 2 rows a step (1 at the end): within the limits
    before = teacher_forced_logits(runner, segments)
    runner.seqs.clear()
    for m in runner.model.modules():
        if isinstance(m, Linear):
            m.weight.data.zero_()  # the untied head too; the embedding table is apart
    after = teacher_forced_logits(runner, segments)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert float(before[0].abs().max()) > 1.0


def test_int4_quantize_round_trips_representable_weights_exactly():
    torch.manual_seed(4)
    q = torch.randint(0, 16, (16, 64), dtype=torch.int32)
    # each group of 32 reaches both ends
    q[:, 3] = 0
    q[:, 4] = 15
    q[:, 40] = 15
    q[:, 50] = 0
    s = 2.0 ** -torch.randint(2, 12, (16, 2)).float()
    z = torch.randint(-20, 21, (16, 2)).float() * s  # every value an integer multiple of s below 2^8: exact in bf16
    weight = ((q.float().view(16, 2, 32) - 8) * s[..., None] + z[..., None]).view(16, 64)
    weight[3, 32:] = 0.3  # a constant group: scale 0, q = 8, the value rounded to bfloat16
    for dtype in (torch.float32, torch.bfloat16):
        got = quantize_int4(weight.to(dtype))
        assert got.q.dtype == torch.int32 and got.scales.dtype == got.zeros.dtype == torch.bfloat16
        assert torch.equal(got.q[:3], q[:3]) and torch.equal(got.q[4:], q[4:]) and torch.equal(got.q[3, :32], q[3, :32])
        assert bool((got.q[3, 32:] == 8).all()) and float(got.scales[3, 1]) == 0.0
        assert float(got.zeros[3, 1]) == float(torch.tensor(0.3).to(torch.bfloat16))
        expect = weight.clone()
        expect[3, 32:] = torch.tensor(0.3).to(torch.bfloat16).float()
        assert torch.equal(dequantize_int4(got), expect)
        assert torch.equal(dequantize_int4(got, dtype), expect.to(dtype))
    got32 = quantize_int4(weight, scale_dtype=torch.float32)
    assert got32.scales.dtype == torch.float32 and torch.equal(got32.q[:3], q[:3])


def test_int4_quantize_errors_stay_within_half_a_step_of_the_group():
    torch.manual_seed(5)
    weight = torch.randn(32, 96) * torch.logspace(-3, 1, 32)[:, None] + 0.05
    got = quantize_int4(weight)
    wg = weight.view(32, 3, 32)
    lo = wg.amin(-1)
    hi = wg.amax(-1)
    exact_s = (hi - lo) / 15
    assert torch.equal(got.scales, exact_s.to(torch.bfloat16))  # the same float32 ops, then one rounding
    assert int(got.q.min()) == 0 and int(got.q.max()) == 15
    s = got.scales.float()
    z = got.zeros.float()
    bound = s / 2 + 8 * (s - exact_s).abs() + (z - (lo + 8 * exact_s)).abs()
    err = (wg - dequantize_int4(got).view(32, 3, 32)).abs()
    assert bool((err <= bound[..., None] * (1 + 1e-5) + 1e-9).all())
    assert float((err / s[..., None]).max()) > 0.45  # the bound is near tight: round to nearest leaves ~half a step
    with pytest.raises(ValueError, match=r"K % 32 == 0, got shape \(4, 48\)"):
        quantize_int4(torch.ones(4, 48))
    with pytest.raises(ValueError, match=r"2-D weight \[N, K\] with K % 32 == 0, got shape \(64,\)"):
        quantize_int4(torch.ones(64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_linear_equals_the_dense_product_of_the_dequantized_weight(dtype):
    torch.manual_seed(6)
    groups = quantize_int4(torch.randn(80, 128) * 0.1)  # N = 80: one full block of 64 columns and a block of 16
    w = pack_int4(groups)
    assert w.qweight.shape == (80, 64) and w.scales_and_zeros.shape == (4, 80, 2) and w.group_size == 32
    x = torch.randn(5, 128).to(dtype)  # 5 rows: a block of 4 and a block of 1
    bias = torch.randn(80).to(dtype)
    got = int4_linear(x, w, bias)
    assert got.dtype == dtype and got.shape == (5, 80)
    product = int4_linear(x, w)
    assert torch.equal(got, product + bias)  # int4_linear adds the bias after the kernel: the same two ops
    ref = F.linear(x.to(torch.bfloat16).double(), dequantize_int4(groups, torch.float64))
    # float32 accumulation rounded once to bfloat16: within 2^-8 relative (2^-9 per rounding, and float32 sums)
    assert bool(((product.double() - ref).abs() <= 2.0**-8 * ref.abs() + 1e-4).all())
    assert float((product.double() - ref).abs().max()) > 0  # rounded: a wrong layout would be off by whole values
    assert torch.equal(int4_linear(x.view(5, 1, 128), w, bias), got.view(5, 1, 80))  # the same kernel, same values
    flat = torch.zeros(1 + 5 * 128, dtype=dtype)  # a view 2 or 4 bytes into its storage: the kernel loads unaligned
    flat[1:] = x.flatten()
    assert torch.equal(int4_linear(flat[1:].view(5, 128), w, bias), got)
    with pytest.raises(RuntimeError):
        int4_linear(torch.ones(1, 96), w)


def test_int4_linear_sends_up_to_max_rows_to_the_int4_copy_and_keeps_unfit_shapes_dense(torch_kernels):
    assert INT4_MAX_ROWS[torch.bfloat16] == 12 and INT4_MAX_ROWS[torch.float32] == 16
    torch.manual_seed(7)
    for dtype, limit in ((torch.bfloat16, 12), (torch.float32, 16)):
        lin = Linear(torch.randn(32, 64).to(dtype), quantization="int4")
        assert lin.scheme == "int4" and lin.max_rows == limit and lin.int8 is None and lin.int4 is not None
        assert lin.scales is not None and lin.scales.shape == (2, 32, 2) and lin.scales.dtype == torch.bfloat16
        lin.weight.data.zero_()  # the dense copy now gives zeros: a nonzero output came from the int4 copy
        for rows in (1, limit - 1, limit, limit + 1, limit + 5):
            y = lin(torch.ones(rows, 64, dtype=dtype))
            assert y.dtype == dtype and y.shape == (rows, 32)
            assert lin.uses_quantized(rows) == (rows <= limit) == bool(y.abs().sum() > 0), (dtype, rows)
    int4_copy = Linear(torch.randn(32, 64), quantization="int4").int4
    assert int4_copy is not None
    assert int4_copy.qweight.nbytes + int4_copy.scales_and_zeros.nbytes == 32 * 32 + 2 * 32 * 2 * 2
    for shape in ((24, 64), (32, 48)):  # N not a multiple of 16, K not of 32: the kernel cannot take them
        odd = Linear(torch.randn(*shape), quantization="int4")
        assert odd.qweight is None and odd.scheme == "none" and not odd.uses_quantized(1)
        assert torch.equal(odd(torch.ones(1, shape[1])), F.linear(torch.ones(1, shape[1]), odd.weight))


def test_int4_groups_unpack_the_kernel_layout():
    # the packed weight times the identity gives back the dequantized weight (bfloat16-rounded)
    groups = quantize_int4(torch.randn(64, 64))
    eye = torch.eye(64, dtype=torch.bfloat16)
    back = int4_linear(eye, pack_int4(groups)).t()
    assert torch.equal(back, dequantize_int4(groups, torch.bfloat16))
    assert isinstance(groups, Int4Groups)
