"""`--quantization auto` (runtime/model/quant_plan.py): each linear keeps at least its file's precision; a fused linear
takes its most precise part; the head never goes below int8; a float checkpoint and a non-CPU device get none; the
fixed choices stay uniform. The model built from a plan has exactly those schemes."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import cpu_qgemv
from runtime.config import ServerArgs
from runtime.model.gguf_convert import GGUF_TYPES_FILE
from runtime.model.loader import load_config, load_weights
from runtime.model.models import build_model
from runtime.model.quant_plan import QuantPlan
from runtime.model.runner import ModelRunner

L0 = "model.layers.0"
Q4_K_M_LIKE = {  # Gemma 3 270M's Q4_K_M layer 0, as its file stores it, but o_proj Q4_1 (Q4_K runs int8)
    f"{L0}.self_attn.q_proj.weight": "Q5_0",
    f"{L0}.self_attn.k_proj.weight": "Q5_0",
    f"{L0}.self_attn.v_proj.weight": "Q8_0",
    f"{L0}.self_attn.o_proj.weight": "Q4_1",
    f"{L0}.mlp.gate_proj.weight": "Q5_0",
    f"{L0}.mlp.up_proj.weight": "Q5_0",
    f"{L0}.mlp.down_proj.weight": "Q6_K",
    "model.embed_tokens.weight": "Q8_0",
    "model.norm.weight": "F32",
}


def test_auto_maps_each_type_to_the_scheme_that_keeps_its_bits():
    expected = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int8", "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8"}
    expected.update({"Q6_K": "int8", "Q8_0": "int8", "F32": "none", "F16": "none", "BF16": "none"})
    for gguf_type, scheme in expected.items():
        assert QuantPlan("auto", {"w": gguf_type}).scheme("w") == scheme, gguf_type
    assert QuantPlan("auto", {}).scheme("w") == "none"  # not a GGUF tensor: stored in floating point


def test_auto_runs_q4_k_int8_with_the_qgemv_op_on_or_off(monkeypatch):
    """Above the op's few rows torch's int4 path would round Q4_K's groups a second time: int8 either way."""
    for on in (True, False):
        monkeypatch.setattr(cpu_qgemv, "ENABLED", on)
        plan = QuantPlan("auto", {"w": "Q4_K", "v": "Q4_1"})
        assert plan.scheme("w") == "int8" and plan.scheme("v") == "int4" and plan.head_scheme("w") == "int8"


def test_fused_linear_takes_its_most_precise_part_and_the_head_stays_int8():
    plan = QuantPlan("auto", {"a": "Q4_1", "b": "Q6_K", "c": "F16", "h": "Q4_0"})
    assert plan.scheme("a") == "int4"
    assert plan.scheme("a", "b") == "int8"
    assert plan.scheme("a", "b", "c") == "none"
    assert plan.head_scheme("h") == "int8" and plan.head_scheme("b") == "int8" and plan.head_scheme("c") == "none"
    for fixed in ("none", "int8", "int4"):
        assert QuantPlan(fixed, {"a": "F32"}).scheme("a", "b") == fixed
    assert QuantPlan("int4").head_scheme("x") == "int8"


def test_bad_choices_are_refused():
    with pytest.raises(ValueError, match=r"quantization 'int3'; supported: \['auto', 'none', 'int8', 'int4'\]"):
        QuantPlan("int3")
    with pytest.raises(ValueError, match=r"GGUF type\(s\) \['IQ2_XS'\] have no scheme"):
        QuantPlan("auto", {"w": "IQ2_XS"})


def test_for_folder_reads_the_types_and_gives_none_off_the_cpu(tmp_path):
    (tmp_path / GGUF_TYPES_FILE).write_text(json.dumps(Q4_K_M_LIKE))
    plan = QuantPlan.for_folder("auto", tmp_path)
    assert plan.scheme(f"{L0}.self_attn.o_proj.weight") == "int4" and plan.uses_kernels
    assert plan.describe() == "auto (int4: 1 tensors, int8: 7 tensors, none: 1 tensors)"
    assert QuantPlan.for_folder("auto", tmp_path, "cuda").quantization == "none"
    assert not QuantPlan.for_folder("auto", tmp_path / "missing").uses_kernels  # a float checkpoint
    assert QuantPlan.for_folder("int8", tmp_path, "cuda").quantization == "int8"  # refused later, by build_model
    assert ServerArgs().quantization == "auto"


def _schemes(model) -> dict[str, str]:
    return {name: m.scheme for name, m in model.named_modules() if hasattr(m, "scheme")}


def test_model_built_from_a_plan_has_each_linears_scheme(tiny_llama_dir, tmp_path):
    cfg = load_config(tiny_llama_dir)
    plan = QuantPlan("auto", Q4_K_M_LIKE)
    model = build_model(cfg, load_weights(tiny_llama_dir, torch.float32), 64, quantization=plan)
    schemes = _schemes(model)
    assert schemes["layers.0.self_attn.qkv_proj"] == "int8"  # Q5_0 + Q5_0 + Q8_0
    assert schemes["layers.0.self_attn.o_proj"] == "int4"  # Q4_1
    assert schemes["layers.0.mlp.gate_up_proj"] == "int8"  # Q5_0 + Q5_0
    assert schemes["layers.0.mlp.down_proj"] == "int8"  # Q6_K
    assert schemes["layers.1.self_attn.o_proj"] == "none"  # layer 1 is not in the file's table: float
    head = "int8" if cfg.tie_word_embeddings else "none"  # tied: the embedding's Q8_0; untied: lm_head, not listed
    assert schemes["lm_head"] == head


def test_runner_on_a_float_checkpoint_runs_dense_under_auto(tiny_llama_dir):
    runner = ModelRunner(ServerArgs(model=str(tiny_llama_dir), num_blocks=16, dtype="float32"))
    assert runner.quantization.quantization == "auto" and not runner.quantization.uses_kernels
    assert set(_schemes(runner.model).values()) == {"none"}


def test_auto_on_the_embedded_smollm2_is_int4_with_an_int8_head():
    """SmolLM2's GGUF stores every projection in Q4_1 and the tied embedding in Q8_0: auto picks what
    --quantization int4 gives (whose agreement test_quant_agreement.py measures)."""
    from runtime.model.loader import resolve_model

    folder = resolve_model("smollm2")
    auto = QuantPlan.for_folder("auto", folder)
    types = json.loads((folder / GGUF_TYPES_FILE).read_text())
    projections = [n for n in types if n.endswith("_proj.weight")]
    assert len(projections) == 30 * 7 and {types[n] for n in projections} == {"Q4_1"}
    assert all(auto.scheme(n) == "int4" for n in projections)
    assert auto.head_scheme("model.embed_tokens.weight") == "int8" == QuantPlan("int4").head_scheme("x")
