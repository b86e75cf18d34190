"""SmolLM2 int4 with the qgemv op (the default) against transformers' float32 on the same GGUF weights.

SmolLM2's projections are Q4_1 and its embedding (the head) Q8_0: the op stores both on the file's own grid
(runtime/model/quant_groups.py), so the quantized model multiplies the very weights transformers loads, and the op's
only departure from float32 is its activations' int16 rounding (relative error ~3e-5 per layer: benchmarks/
qgemv_accuracy.py). Greedy decoding one prompt at a time (every decode step 1 row: the op serves every projection
and the head) must then give transformers' tokens by the project's rule (equal, or the first difference at a near-tie
of the reference: tests/conftest.py _assert_same_greedy).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kernels import cpu_decode_layer, cpu_qgemv
from runtime.config import ServerArgs
from runtime.model import quant
from runtime.model.loader import resolve_model
from runtime.model.runner import ModelRunner

pytestmark = pytest.mark.slow  # a model against transformers' generate: 473 s measured at load average ~12

NEW_TOKENS = 16
PROMPTS = 2  # of conftest.CHAT_PROMPTS


def test_int4_greedy_tokens_on_the_op_equal_transformers_float32(
    monkeypatch, chat_prompt_ids, runner_greedy, hf_greedy
):
    monkeypatch.setattr(cpu_qgemv, "ENABLED", True)  # the default, unless RADIXSERVE_CPU_QGEMV=0
    calls = []

    def counted(x, w, isa, bias=None):
        calls.append(x.numel() // x.shape[-1])
        return group_linear(x, w, isa, bias)

    group_linear = quant.group_linear
    monkeypatch.setattr(quant, "group_linear", counted)
    layer_calls = []
    decode_layer = cpu_decode_layer.decode_layer
    monkeypatch.setattr(cpu_decode_layer, "decode_layer", lambda *a: layer_calls.append(1) or decode_layer(*a))
    runner = ModelRunner(ServerArgs(model="smollm2", num_blocks=64, dtype="float32", quantization="int4"))
    head = runner.model.lm_head
    down = runner.model.layers[0].mlp.down_proj
    assert head.kernel == "qgemv" and head.scheme == "int8" and down.kernel == "qgemv" and down.scheme == "int4"
    assert down.uses_quantized(1) and down.max_rows >= 1
    assert torch.equal(down.dequantized(1), down.weight.detach().float())  # Q4_1 on its own grid: no second rounding
    hf_generate, assert_same = hf_greedy
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model("smollm2")), dtype=torch.float32).eval()
    for prompt in chat_prompt_ids[:PROMPTS]:
        calls.clear()
        layer_calls.clear()
        mine = runner_greedy(runner, [prompt], NEW_TOKENS)[0]
        # every decode step ran each of the 30 layers in the C++ decode layer (its 4 linears on the op) and the head
        # on the op, and the prefill its head (its last position only)
        assert len(layer_calls) == (NEW_TOKENS - 1) * 30
        assert calls.count(1) == len(calls) == (NEW_TOKENS - 1) + 1
        ((ref, ref_logits),) = hf_generate(hf, [prompt], NEW_TOKENS)
        assert_same(mine, ref, ref_logits)
