"""min_tokens on the embedded SmolLM2 (float32) through the Engine: a chat whose greedy answer ends early ("Yes."
then EOS after 3 tokens) keeps EOS away for exactly min_tokens tokens, with the same tokens as transformers'
generate(min_new_tokens=...), which masks EOS the same way (MinNewTokensLengthLogitsProcessor)."""

from __future__ import annotations

import pytest
import torch

from runtime.engine import Engine
from runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # loads the 135M model twice (ours and transformers'): about 30 s

QUESTION = [{"role": "user", "content": "Say only the word yes."}]
MIN_TOKENS = 6
MAX_TOKENS = 10
NEAR_TIE = 1e-3  # the project's identical-outputs rule (tests/conftest.py _assert_same_greedy)


def test_min_tokens_keeps_eos_away_exactly_until_then():
    engine = Engine(model="smollm2", num_blocks=64, block_size=16, dtype="float32")
    eos = sorted(engine.scheduler.eos_token_ids)
    free = engine.generate(messages=[QUESTION], sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    held = engine.generate(
        messages=[QUESTION],
        sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0, min_tokens=MIN_TOKENS, logprobs=2),
    )[0]
    engine.shutdown()
    assert free[0].finish_reason == "stop" and len(free[0].token_ids) < MIN_TOKENS  # it ends early unheld
    assert not set(held.token_ids[:MIN_TOKENS]) & set(eos)

    from transformers import AutoModelForCausalLM

    from runtime.model.loader import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2"), dtype=torch.float32).eval()
    prompt = torch.tensor([held.prompt_token_ids])  # the chat template's ids, as the Engine encoded them
    with torch.no_grad():
        ref = model.generate(
            prompt,
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MIN_TOKENS,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            output_scores=True,
            return_dict_in_generate=True,
        )
    ref_ids = ref.sequences[0, prompt.shape[1] :].tolist()
    if ref_ids and ref_ids[-1] in eos:
        assert held.finish_reason == "stop"
    differ = [i for i, (a, b) in enumerate(zip(held.token_ids, ref_ids, strict=False)) if a != b]
    if not differ:
        assert held.token_ids == ref_ids
    else:  # only at a near-tie of the reference
        top2 = ref.scores[differ[0]][0].topk(2).values
        assert float(top2[0] - top2[1]) < NEAR_TIE, f"differs from transformers at token {differ[0]}"
