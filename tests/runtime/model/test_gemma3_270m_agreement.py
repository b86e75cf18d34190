"""bfloat16 against float32 on the embedded gemma3-270m (real weights): teacher-forced top-1 agreement judged against
transformers' own bfloat16 forward of the same model on this machine (tests/runtime/model/agreement.py states the
rules), never against a constant tuned on one CPU.

The text: the last 160 tokens of each prompt of fixtures/gemma3_270m_greedy.json and transformers' 24 greedy tokens
after it (3 segments, 244 predicted positions), fed to our runner one token a step for all segments at once (the
decode regime) and to transformers in one forward per segment. The float32 reference is transformers' float32 on the
same converted weights (ours matches it token for token: test_gemma3_270m.py). The quantized paths' agreement is
measured the same way in the README (`--quantization auto` runs Q4_K int8 because of it).
"""

from __future__ import annotations

import json

import pytest
import torch

from runtime.config import ServerArgs
from runtime.model.loader import resolve_model
from runtime.model.runner import ModelRunner
from tests.runtime.model.agreement import Agreement, assert_within_reference, compare, describe
from tests.runtime.model.gemma3_reference import FIXTURE
from tests.runtime.model.step_logits import teacher_forced_logits

pytestmark = pytest.mark.slow  # transformers and our runner on a 270M model: minutes on 2 cores

PREFIX_TOKENS = 160


@pytest.fixture(scope="module")
def segments() -> list[list[int]]:
    ref = json.loads(FIXTURE.read_text())
    return [p[-PREFIX_TOKENS:] + t for p, t in zip(ref["prompt_ids"], ref["token_ids"], strict=True)]


@torch.inference_mode()
def _transformers_logits(segments: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model("gemma3-270m")), dtype=dtype).eval()
    return torch.cat([model(torch.tensor([s])).logits[0, :-1].float() for s in segments])


@pytest.fixture(scope="module")
def measured(segments) -> dict[str, Agreement]:
    float32 = _transformers_logits(segments, torch.float32)
    hf_bf16 = _transformers_logits(segments, torch.bfloat16)
    # teacher_forced_logits builds one block table per sequence (no window tables): one KV cache group
    args = ServerArgs(model="gemma3-270m", dtype="bfloat16", quantization="none", num_blocks=64, kv_groups="single")
    runner = ModelRunner(args)
    ours = torch.cat(teacher_forced_logits(runner, segments))
    return {"ours": compare(float32, ours), "hf": compare(float32, hf_bf16)}


def test_bf16_flips_only_near_ties_and_no_more_often_than_transformers(segments, measured, record_property):
    for name, c in measured.items():
        print(describe(f"gemma3-270m bfloat16 {name}", c))
        record_property(f"{name}_agreement", c.agreement)
    assert measured["ours"].positions == 244  # 6, 9 and 160 prompt tokens (the last ones), 24 reference tokens each
    assert_within_reference(measured["ours"], measured["hf"])
