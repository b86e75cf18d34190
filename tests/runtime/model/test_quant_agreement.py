"""The quantized models' teacher-forced top-1 agreement with float32 on real text (runtime/model/quant.py,
quant_int4.py), judged against transformers running the same quantized weights on this machine, never against a
constant tuned on one CPU.

Measured in the same run, on the same text: float32 = transformers' float32 SmolLM2 (which the runner's float32 model
matches within 1e-3, test_model.py); the quantized reference = transformers at bfloat16 (the precision our int8 and
int4 kernels compute in, whatever the model dtype) with every linear weight replaced by the dequantized weight our
kernels multiply (tests/runtime/model/agreement.py, transformers_logits); dense bfloat16 = transformers' bfloat16.

Rules: 1 and 2 of tests/runtime/model/agreement.py against the quantized reference (flips only at near-ties, where
float32's top-2 gap is below the largest top-2 shift the reference's error produced; no more flips than the
reference's count plus its chance spread); and 3: ours' largest logit difference from float32 is at most the
reference's plus 2E, E the largest logit difference of transformers' own dense bfloat16 from its float32 on this text
(the rounding error of bfloat16 on this machine). Ours and the reference compute the same quantized model Q, each
within about E of it, so |ours - float32| <= |ours - Q| + |Q - reference| + |reference - float32| (triangle
inequality). A wrong scale, zero or layout moves logits by far more.
The figures are printed and attached to the test report (record_property).
"""

from __future__ import annotations

import pytest
import torch

from runtime.config import ServerArgs
from runtime.model.runner import ModelRunner
from tests.runtime.model.agreement import (
    assert_within_reference,
    compare,
    describe,
    transformers_logits,
)
from tests.runtime.model.step_logits import teacher_forced_logits

pytestmark = pytest.mark.slow  # a model against transformers: seconds per test

# Real text of four kinds (a novel's opening, an explanation, a recipe, code): 461 tokens, 457 predicted positions.
PASSAGES = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a "
    "wife. However little known the feelings or views of such a man may be on his first entering a neighbourhood, this "
    "truth is so well fixed in the minds of the surrounding families, that he is considered the rightful property of "
    'some one or other of their daughters. "My dear Mr. Bennet," said his lady to him one day, "have you heard that '
    'Netherfield Park is let at last?" Mr. Bennet replied that he had not. "But it is," returned she; "for Mrs. '
    'Long has just been here, and she told me all about it."',
    "A bicycle stays upright mostly because the rider steers it. When the bike starts to lean to one side, the rider "
    "turns the front wheel slightly in the same direction, which moves the wheels back under the centre of mass. The "
    "shape of the front fork also helps: because the wheel touches the ground behind the line of the steering axis, a "
    "leaning bike tends to turn into the lean by itself. At higher speeds these corrections happen faster and need "
    "smaller movements, which is why riding slowly feels harder than riding quickly.",
    "To make a simple loaf of bread, mix five hundred grams of flour with ten grams of salt and seven grams of dried "
    "yeast. Add about three hundred and fifty millilitres of warm water and stir until a rough dough forms. Knead it "
    "on a floured table for ten minutes, until it feels smooth and springs back when pressed. Leave it in a covered "
    "bowl in a warm place for an hour, then shape it, let it rise again, and bake it at two hundred and twenty degrees "
    "for about thirty minutes.",
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n    out = []\n'
    "    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n"
    "            i += 1\n        else:\n            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n"
    "    out.extend(b[j:])\n"
    "    return out\n",
]
POSITIONS = 457
STEP_ROWS = 4  # one row per passage: every step runs the quantized kernels (4 <= every row limit)


@pytest.fixture(scope="module")
def passage_ids(smollm2_tokenizer) -> list[list[int]]:
    return [list(smollm2_tokenizer(p)["input_ids"]) for p in PASSAGES]


def _predicting(per_passage: list[torch.Tensor]) -> torch.Tensor:
    """Rows of every passage's logits after each token but the last (the predicted positions), concatenated."""
    return torch.cat([logits[:-1] for logits in per_passage])


@pytest.fixture(scope="module")
def float32_logits(passage_ids) -> torch.Tensor:
    """transformers' float32 logits [POSITIONS, vocab]."""
    return _predicting(transformers_logits(passage_ids, torch.float32))


@pytest.fixture(scope="module")
def dense_bf16_error(passage_ids, float32_logits) -> float:
    """E: the largest |logit difference| of transformers' dense bfloat16 against its float32 on the passages."""
    return compare(float32_logits, _predicting(transformers_logits(passage_ids, torch.bfloat16))).max_abs_diff


def _judge(
    name: str, mine: torch.Tensor, reference: torch.Tensor, float32: torch.Tensor, dense_error: float, record_property
) -> None:
    """Compares mine and the quantized reference (float32 [POSITIONS, vocab] logits) with float32, prints and records
    the figures, then asserts rules 1-3 (module docstring)."""
    ours = compare(float32, mine)
    ref = compare(float32, reference)
    print(describe(name, ours))
    print(describe(f"{name} reference (transformers, bfloat16, the same quantized weights)", ref))
    bound = ref.max_abs_diff + 2 * dense_error
    print(
        f"{name}: transformers' dense bfloat16 vs float32: largest logit difference {dense_error:.3f}; "
        f"rule 3 bound {bound:.3f}"
    )
    for label, c in (("ours", ours), ("reference", ref)):
        record_property(f"{name}_{label}_top1_agreement", round(c.agreement, 4))
        record_property(f"{name}_{label}_flip_gaps", [round(g, 3) for g in c.flip_gaps])
        record_property(f"{name}_{label}_max_top2_shift", round(c.max_pair_shift, 3))
        record_property(f"{name}_{label}_max_abs_logit_diff", round(c.max_abs_diff, 3))
    record_property("dense_bf16_max_abs_logit_diff", round(dense_error, 3))
    assert ours.positions == POSITIONS
    assert_within_reference(ours, ref)
    assert ours.max_abs_diff <= bound


def test_int8_model_agrees_with_float32_on_top1_of_real_text(
    passage_ids, float32_logits, dense_bf16_error, record_property
):
    runner = ModelRunner(ServerArgs(model="smollm2", num_blocks=64, dtype="bfloat16", quantization="int8"))
    head = runner.model.lm_head
    assert head.scheme == "int8" and head.uses_quantized(STEP_ROWS)  # every projection reads int8
    mine = torch.cat(teacher_forced_logits(runner, passage_ids))
    reference = _predicting(transformers_logits(passage_ids, torch.bfloat16, "int8", rows=STEP_ROWS))
    _judge("int8", mine, reference, float32_logits, dense_bf16_error, record_property)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int4_model_agrees_with_float32_on_top1_of_real_text(
    passage_ids, float32_logits, dense_bf16_error, dtype, record_property
):
    runner = ModelRunner(ServerArgs(model="smollm2", num_blocks=64, dtype=dtype, quantization="int4"))
    layer = runner.model.layers[0]
    head = runner.model.lm_head
    assert layer.mlp.down_proj.scheme == "int4" and head.scheme == "int8"
    assert layer.mlp.down_proj.uses_quantized(STEP_ROWS) and head.uses_quantized(STEP_ROWS)
    mine = torch.cat(teacher_forced_logits(runner, passage_ids))
    weight_dtype = getattr(torch, dtype)  # the runner quantizes its weights as loaded in its dtype
    reference = _predicting(transformers_logits(passage_ids, torch.bfloat16, "int4", weight_dtype, STEP_ROWS))
    _judge(f"int4_{dtype}", mine, reference, float32_logits, dense_bf16_error, record_property)
