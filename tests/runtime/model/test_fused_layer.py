"""The C++ decode layer (kernels/cpu_decode_layer.cpp, runtime/model/models/fused_layer.py) against the Python layer
it replaces, on tiny int4 models of the families it runs (Llama's norms and SiLU; Gemma 3's norms, q/k norms, GELU,
sliding window and local rope; Qwen3's q/k norms), and where it must step aside."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode_layer, cpu_qgemv
from kernels.errors import KernelInputError
from runtime.config import ServerArgs
from runtime.model.cpu_features import cpu_flags
from runtime.model.models.batch import decode_metadata
from runtime.model.runner import ModelRunner
from tests.runtime.model.tiny_families import save_tiny_family

# The op runs on the qgemv op's copies, which Linear builds only where the op beats torch's kernels (AVX2, AVX-512).
pytestmark = pytest.mark.skipif(cpu_qgemv.isa_for(cpu_flags()) == "scalar", reason="no qgemv op on a scalar CPU")

BLOCK = 16


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen3"])
def tiny_folder(request, tmp_path_factory, smollm2_tokenizer, tiny_llama_dir):
    if request.param == "llama":
        return tiny_llama_dir
    return save_tiny_family(request.param, tmp_path_factory.mktemp(request.param), smollm2_tokenizer)


def _model(folder, dtype: str) -> torch.nn.Module:
    args = ServerArgs(model=str(folder), dtype=dtype, quantization="int4", num_blocks=64, block_size=BLOCK)
    return ModelRunner(args).model


def _step(layer, contexts: list[int], seed: int):
    """x, the decode metadata of one token per sequence at positions contexts[i], and K/V caches holding random
    context: sequence i owns blocks 1 + 4i .. 4 + 4i."""
    attn = layer.self_attn
    dtype = attn.rotary.cos.dtype
    g = torch.Generator().manual_seed(seed)
    hidden = attn.qkv_proj.weight.shape[1]
    x = torch.randn(len(contexts), hidden, generator=g).to(dtype)
    shape = (1 + 4 * len(contexts), BLOCK, attn.num_kv_heads, attn.head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    tables = torch.tensor([[1 + 4 * i + j for j in range(4)] for i in range(len(contexts))], dtype=torch.int32)
    slots = [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for i, p in enumerate(contexts)]
    meta = decode_metadata(contexts, slots, tables, list(range(len(contexts))), torch.device("cpu"))
    return x, meta, k_cache, v_cache


def _both_ways(layer, x, meta, k_cache, v_cache):
    """(fused output, its caches), (Python output, its caches), each from copies of the same caches."""
    k1, v1, k2, v2 = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    with torch.inference_mode():
        fused = layer.fused_decode(x, meta, k1, v1)
        saved = layer.fused_decode
        layer.fused_decode = lambda *a: None
        try:
            python = layer(x, meta, k2, v2)
        finally:
            layer.fused_decode = saved
    return (fused, k1, v1), (python, k2, v2)


def _assert_same(fused, python, dtype: str, rows: int = 1, bf16_kernel: bool = False) -> None:
    """The op's output, K and V against the Python layer's. bfloat16 at one row: the very bits (every rounding point
    is Python's). Otherwise they may differ by float32 rounding (sums of squares in another order than torch's, whose
    reduction order changes with the rows), which can move a later rounding of a value by one step: a bfloat16
    step (2^-8 of the value; also float32 models where torch's int4 / int8 kernel runs, bf16_kernel: they take
    bfloat16 x), or the qgemv op's int16 step (1 / XQ_MAX of its group's largest value) in float32: a few such steps
    relative to the output's scale are allowed, and in bfloat16 most values must still be equal."""
    if dtype == "bfloat16" and rows == 1:
        for mine, theirs in zip(fused, python, strict=True):
            assert torch.equal(mine, theirs)
        return
    step = 2.0**-8 if dtype == "bfloat16" or bf16_kernel else 1.0 / cpu_qgemv.XQ_MAX
    for mine, theirs in zip(fused, python, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=4 * step * theirs.abs().max().item())
        if dtype == "bfloat16":
            assert (mine == theirs).double().mean().item() > 0.9


# Rows of the tests' steps: 1 (the qgemv op on AVX-512 and AVX2), 2 (torch's int4 kernel on AVX-512 VNNI, the op on
# AVX2 and, in bfloat16, on AVX512_BF16), 14 (past torch's int4 limit, 12 in bfloat16: F.linear in bfloat16, but the
# op's bfloat16 dot products on AVX512_BF16; torch's kernel in float32) and 17 (past every quantized limit: F.linear).
CONTEXTS = ([37], [5, 63], [3, 9, 17, 22, 40, 51, 60, 12, 33, 44, 1, 30, 58, 25], [7] * 17)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_layer_equals_the_python_layer(tiny_folder, dtype):
    """Every layer, at each row count of CONTEXTS: each projection runs the kernel its Linear picks for the rows."""
    model = _model(tiny_folder, dtype)
    for index, layer in enumerate(model.layers):
        paths = set()
        for contexts in CONTEXTS:
            x, meta, k_cache, v_cache = _step(layer, contexts, seed=index)
            rows = len(contexts)
            paths.add(layer.mlp.down_proj.path(rows))
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            fused, python = _both_ways(layer, x, meta, k_cache, v_cache)
            assert fused[0] is not None
            _assert_same(fused, python, dtype, rows, any(p.path(rows) in ("int4", "int8") for p in linears))
        assert "qgemv" in paths and len(paths) >= 2


def test_qkv_bias_and_8_bit_groups_equal_the_python_layer(tiny_llama_dir):
    """A qkv bias (Qwen2's) added after the qgemv op (2 rows) and torch's int8 kernel (3 rows, on AVX-512 VNNI), inside
    F.linear (13 rows, past every int8 limit in bfloat16: 4 for torch's kernel and the op's AVX2 code, 12 for its
    bfloat16 dot products)."""
    args = ServerArgs(model=str(tiny_llama_dir), dtype="bfloat16", quantization="int8", num_blocks=64)
    model = ModelRunner(args).model
    layer = model.layers[1]
    qkv = layer.self_attn.qkv_proj
    qkv.bias = torch.nn.Parameter(torch.randn(qkv.weight.shape[0]).to(qkv.weight.dtype), requires_grad=False)
    paths = []
    for contexts in ([3, 40], [3, 40, 17], [3, 40, 17, 8, 60, 29, 5, 9, 11, 13, 20, 22, 24]):
        paths.append(qkv.path(len(contexts)))
        x, meta, k_cache, v_cache = _step(layer, contexts, seed=3)
        fused, python = _both_ways(layer, x, meta, k_cache, v_cache)
        assert fused[0] is not None
        _assert_same(fused, python, "bfloat16", len(contexts))
    # torch's int8 copy serves the rows between the op's limit and its own, where there are any (not on AVX2)
    assert paths[0] == "qgemv" and paths[2] == "dense"
    assert paths[1] == ("int8" if qkv.torch_rows > qkv.max_rows else "qgemv")


def test_a_padding_slot_is_not_written_and_a_slot_past_the_cache_is_refused(tiny_llama_dir):
    model = _model(tiny_llama_dir, "bfloat16")
    layer = model.layers[0]
    x, meta, k_cache, v_cache = _step(layer, [20], seed=1)
    meta.slot_mapping = torch.tensor([-1])
    fused, python = _both_ways(layer, x, meta, k_cache, v_cache)
    assert torch.equal(fused[1], k_cache) and torch.equal(fused[2], v_cache)
    _assert_same(fused, python, "bfloat16")
    meta.slot_mapping = torch.tensor([64 * BLOCK])
    k1 = k_cache.clone()
    with torch.inference_mode(), pytest.raises(KernelInputError, match="outside the cache"):
        layer.fused_decode(x, meta, k1, v_cache)
    assert torch.equal(k1, k_cache)


def test_the_python_layer_runs_what_the_op_does_not(tiny_llama_dir, monkeypatch):
    """A prefill step, a projection made dense after the op ran (a new quantization plan), an unquantized model, a
    disabled op: fused_decode answers None and writes nothing."""
    model = _model(tiny_llama_dir, "float32")
    layer = model.layers[0]
    x, meta, k_cache, v_cache = _step(layer, [20], seed=2)
    second = model.layers[1]
    with torch.inference_mode():
        assert second.fused_decode(x, meta, k_cache.clone(), v_cache.clone()) is not None
    second.mlp.down_proj.set_scheme("none")
    with torch.inference_mode():
        assert second.fused_decode(x, meta, k_cache.clone(), v_cache.clone()) is None
    meta.max_query_len = 2
    k1 = k_cache.clone()
    with torch.inference_mode():
        assert layer.fused_decode(x, meta, k1, v_cache) is None
    assert torch.equal(k1, k_cache)
    plain = ModelRunner(ServerArgs(model=str(tiny_llama_dir), dtype="float32", num_blocks=64)).model
    x, meta, k_cache, v_cache = _step(plain.layers[0], [20], seed=2)
    with torch.inference_mode():
        assert plain.layers[0].fused_decode(x, meta, k_cache, v_cache) is None
    monkeypatch.setattr(cpu_decode_layer, "ENABLED", False)
    monkeypatch.setattr(cpu_decode_layer, "_op", None)
    fresh = _model(tiny_llama_dir, "float32")
    x, meta, k_cache, v_cache = _step(fresh.layers[0], [20], seed=2)
    with torch.inference_mode():
        assert fresh.layers[0].fused_decode(x, meta, k_cache, v_cache) is None


def test_greedy_tokens_equal_with_and_without_the_op(tiny_folder, monkeypatch):
    """bfloat16 int4 greedy decoding through the Engine (Gemma 3 with its two KV cache groups: the sliding layers read
    the window group's tables): the op runs every decode step's layers (counted), and the tokens are the Python
    layer's (its outputs are bit for bit the same in bfloat16)."""
    from runtime.engine import Engine
    from runtime.sampling_params import SamplingParams

    calls = []
    original = cpu_decode_layer.decode_layer
    monkeypatch.setattr(cpu_decode_layer, "decode_layer", lambda *a: calls.append(1) or original(*a))
    prompt = torch.randint(3, 40000, (45,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)
    runs = []
    layers = []
    for enabled in (True, False):
        monkeypatch.setattr(cpu_decode_layer, "ENABLED", enabled)
        monkeypatch.setattr(cpu_decode_layer, "_op", None)
        engine = Engine(model=str(tiny_folder), dtype="bfloat16", quantization="int4", num_blocks=64)
        layers.append(len(engine.runner.model.layers))
        runs.append(engine.generate(input_ids=[prompt], sampling_params=params)[0].token_ids)
        engine.shutdown()
    assert len(runs[0]) == 12
    assert runs[0] == runs[1]
    assert len(calls) == 11 * layers[0]  # 11 decode steps after the prefill's token
