"""The embedded gemma3-270m (Gemma 3 270M Q4_K_M, real weights) end to end: converted once by
runtime.model.gguf_convert, its greedy float32 tokens equal transformers' greedy generate on the same GGUF file
(transformers' own GGUF loading; frozen in fixtures/gemma3_270m_greedy.json by tests/runtime/model/gemma3_reference.py
because it takes minutes), for a short prompt, code and a prompt past the local layers' 512-token window.

Nothing is skipped: without the package the Engine raises ModelNotFoundError, whose message says `make install`.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from runtime.engine import Engine
from runtime.model.gguf_convert import GGUF_TYPES_FILE
from runtime.model.loader import resolve_model
from runtime.model.quant_plan import QuantPlan
from runtime.sampling_params import SamplingParams
from tests.runtime.model.gemma3_reference import FIXTURE, MAX_TOKENS

pytestmark = pytest.mark.slow  # a 270M model with a 262k vocabulary: tens of seconds per test on 2 cores


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(FIXTURE.read_text())


def test_the_file_mixes_the_q4_k_m_types_and_auto_runs_them_int8():
    folder = resolve_model("gemma3-270m")
    types = json.loads((folder / GGUF_TYPES_FILE).read_text())
    assert Counter(types.values()) == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    plan = QuantPlan.for_folder("auto", folder)
    layer = "model.layers.0"
    assert plan.scheme(*(f"{layer}.self_attn.{p}_proj.weight" for p in "qkv")) == "int8"  # Q5_0, Q5_0, Q8_0
    assert plan.scheme(f"{layer}.self_attn.o_proj.weight") == "int8"  # Q4_K: int8 by measured agreement
    assert plan.scheme(f"{layer}.mlp.down_proj.weight") == "int8"  # Q6_K
    assert plan.head_scheme("model.embed_tokens.weight") == "int8"  # tied, Q8_0
    assert {plan.scheme(n) for n in types if n.endswith("_proj.weight")} == {"int8"}


def test_greedy_float32_tokens_equal_transformers_on_the_same_gguf(reference):
    engine = Engine(model="gemma3-270m", dtype="float32", quantization="none", num_blocks=256, block_size=16)
    try:
        assert engine.tokenizer is not None
        assert [engine.tokenizer.encode(p) for p in reference["prompts"]] == reference["prompt_ids"]
        assert len(reference["prompt_ids"][2]) > 512  # past the sliding window
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outs = engine.generate(input_ids=reference["prompt_ids"], sampling_params=params)
        assert [o.token_ids for o in outs] == reference["token_ids"]
    finally:
        engine.shutdown()
