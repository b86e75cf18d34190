"""Weight-only int8 / int4 experts (runtime.model.quant.Linear inside each expert's GatedMLP) against the float32
MoE block, and the whole quantized tiny MoE models against float32 (below), judged against a reference measured in
the same run, never a constant tuned on one CPU.

As in test_quant_agreement.py (rule 3): float32 = transformers' float32 block; the quantized reference =
transformers' block in bfloat16 (the precision our kernels compute in) with each expert weight replaced by the
dequantized weight our kernels multiply (tests/runtime/model/agreement.py, _as_quantized); E = the largest output
difference of transformers' dense bfloat16 block from its float32 one. Ours and the reference compute the same
quantized block, each within about E of it, so |ours - float32| <= |reference - float32| + 2E and |ours - reference|
<= 2E (triangle inequality).
A wrong scale, zero, layout or expert order moves outputs by their own magnitude, far past that bound.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from kernels import cpu_qgemv
from runtime.config import ServerArgs
from runtime.model.models.moe import SparseMoeBlock
from runtime.model.models.moe_weights import MIXTRAL_EXPERT_NAMES, QWEN_EXPERT_NAMES, sparse_moe_block
from runtime.model.models.weights import WeightSource
from runtime.model.runner import ModelRunner
from tests.runtime.model.agreement import _as_quantized, assert_within_reference, compare, describe
from tests.runtime.model.step_logits import teacher_forced_logits
from tests.runtime.model.test_moe_block import HIDDEN, hf_block, load_config_of, rule_of
from tests.runtime.model.tiny_families import random_prompts
from tests.runtime.model.tiny_moe import MOE_FAMILIES, save_tiny_moe

pytestmark = pytest.mark.slow  # about 7 s a test on 2 shared cores


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    """The experts on torch's int8 / int4 kernels (the qgemv op off): their row counts vary across the op's limit."""
    monkeypatch.setattr(cpu_qgemv, "ENABLED", False)


TOKENS = 16  # top 2 of 8 experts: about 4 rows per expert, under every quantized row limit (asserted)


def _quantized_block(hf: torch.nn.Module, family: str, scheme: str) -> SparseMoeBlock:
    weights = {
        "m.gate.weight": hf.gate.weight.detach().clone(),
        "m.experts.gate_up_proj": hf.experts.gate_up_proj.detach().clone(),
        "m.experts.down_proj": hf.experts.down_proj.detach().clone(),
    }
    names = QWEN_EXPERT_NAMES if family == "qwen3_moe" else MIXTRAL_EXPERT_NAMES
    cfg = load_config_of(family, hf)
    return sparse_moe_block(cfg, WeightSource(weights), "m", names, rule_of(family, True), scheme)


def _reference(hf: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """hf's block with every expert weight replaced by what our quantized linears multiply, in bfloat16."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for param in (ref.experts.gate_up_proj, ref.experts.down_proj):
            param.copy_(torch.stack([_as_quantized(w, scheme) for w in param]))
    return ref.to(torch.bfloat16)


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@torch.inference_mode()
def test_quantized_experts_agree_with_float32(family, scheme, record_property):
    hf = hf_block(family)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7))
    float32 = hf(x[None])[0]
    ours_block = _quantized_block(hf, family, scheme)
    counts = torch.bincount(ours_block.route(x).ids.flatten(), minlength=ours_block.num_experts).tolist()
    for expert, count in zip(ours_block.experts, counts, strict=True):
        for linear in (expert.gate_up_proj, expert.down_proj):
            assert linear.scheme == scheme and linear.uses_quantized(count)
    ours = ours_block(x)
    reference = _reference(hf, scheme)(x.to(torch.bfloat16)[None])[0].float()
    dense_bf16 = copy.deepcopy(hf).to(torch.bfloat16)(x.to(torch.bfloat16)[None])[0].float()
    dense_error = float((dense_bf16 - float32).abs().max())
    ours_error = float((ours - float32).abs().max())
    reference_error = float((reference - float32).abs().max())
    bound = reference_error + 2 * dense_error
    to_reference = float((ours - reference).abs().max())
    print(
        f"{family} {scheme}: |ours - float32| {ours_error:.4f}, |reference - float32| {reference_error:.4f}, "
        f"|ours - reference| {to_reference:.4f}, dense bf16 E {dense_error:.4f}, outputs up to "
        f"{float(float32.abs().max()):.2f}"
    )
    record_property(f"{family}_{scheme}_max_abs_diff", round(ours_error, 4))
    record_property(f"{family}_{scheme}_reference_max_abs_diff", round(reference_error, 4))
    record_property(f"{family}_{scheme}_dense_bf16_max_abs_diff", round(dense_error, 4))
    assert 0.0 < ours_error <= bound
    assert to_reference <= 2 * dense_error  # both within E of the same quantized block


# The whole model: the runner's int8 / int4 model (attention projections, experts, int8 head) teacher-forced on two
# random 60-token sequences, two rows a step, against transformers' float32 model and its bfloat16 model with the
# same dequantized weights, by rules 1-3 of test_quant_agreement.py. The tiny random models are far more sensitive
# than a trained one (int4 keeps about a quarter of float32's top-1 here, the reference as much), which the rules,
# being relative to the reference, allow for.
SEQ_LEN = 60


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def tiny_float32(request, tmp_path_factory, smollm2_tokenizer):
    """(folder, segments, transformers' float32 model, its float32 logits, E of its dense bfloat16 copy)."""
    folder = save_tiny_moe(request.param, tmp_path_factory.mktemp(request.param), smollm2_tokenizer)
    segments = random_prompts([SEQ_LEN, SEQ_LEN], seed=3)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    float32 = _logits(hf, segments)
    dense_error = compare(float32, _logits(copy.deepcopy(hf).to(torch.bfloat16), segments)).max_abs_diff
    return folder, segments, hf, float32, dense_error


@torch.inference_mode()
def _logits(model: torch.nn.Module, segments: list[list[int]]) -> torch.Tensor:
    """model's float32 logits after every token but the last of each segment, concatenated [positions, vocab]."""
    return torch.cat([model(torch.tensor([s])).logits[0, :-1].float() for s in segments])


def _quantized_reference(hf: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """hf with every weight our runner quantizes replaced by what its kernels multiply (the head int8), in bfloat16."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for layer in ref.model.layers:
            attn = layer.self_attn
            linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:  # a dense layer (Qwen3-MoE's mlp_only_layers)
                linears += [layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
            else:
                for param in (experts.gate_up_proj, experts.down_proj):
                    param.copy_(torch.stack([_as_quantized(w, scheme) for w in param]))
            for linear in linears:
                linear.weight.copy_(_as_quantized(linear.weight, scheme))
        ref.lm_head.weight.copy_(_as_quantized(ref.lm_head.weight, "int8"))
    return ref.to(torch.bfloat16)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_model_agrees_with_float32_as_transformers_does(tiny_float32, scheme, record_property):
    folder, segments, hf, float32, dense_error = tiny_float32
    args = ServerArgs(model=str(folder), num_blocks=64, dtype="float32", quantization=scheme, kv_groups="single")
    runner = ModelRunner(args)  # single: the test builds block tables by hand (no window tables)
    moe = next(m for m in runner.model.modules() if isinstance(m, SparseMoeBlock))
    assert all(e.down_proj.scheme == scheme and e.down_proj.uses_quantized(len(segments)) for e in moe.experts)
    ours = compare(float32, torch.cat(teacher_forced_logits(runner, segments)))
    ref = compare(float32, _logits(_quantized_reference(hf, scheme), segments))
    print(describe(f"ours {scheme}", ours))
    print(describe(f"reference {scheme}", ref))
    record_property(f"{scheme}_top1_agreement", [round(ours.agreement, 4), round(ref.agreement, 4)])
    assert_within_reference(ours, ref)
    assert ours.max_abs_diff <= ref.max_abs_diff + 2 * dense_error
