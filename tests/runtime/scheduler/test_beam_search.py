"""Beam search (runtime/scheduler/beam_search.py) token-exact against transformers' generate(num_beams=K) on the
embedded SmolLM2 in float32: every beam, in order, with its score; at a fixed length (ignore_eos == transformers'
min_new_tokens) and with EOS allowed."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.engine import Engine
from runtime.model.loader import resolve_model
from runtime.protocol import TokenLogprobs
from runtime.sampling_params import InvalidSamplingParams, SamplingParams
from runtime.scheduler.beam_scores import best_candidates, f32, penalised

EOS = 2  # SmolLM2's <|im_end|>, its one EOS id (transformers pads finished beams with it too)


@pytest.fixture(scope="module")
def smol_hf():
    return AutoModelForCausalLM.from_pretrained(str(resolve_model("smollm2")), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smol_engine():
    return Engine("smollm2", dtype="float32", quantization="none", num_blocks=512, block_size=4)


def _hf_beams(hf, prompt: list[int], k: int, n: int, length_penalty: float, ignore_eos: bool):
    extra = {"min_new_tokens": n} if ignore_eos else {}
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=True,
            max_new_tokens=n,
            output_scores=True,
            return_dict_in_generate=True,
            **extra,
        )
    return [out.sequences[i, len(prompt) :].tolist() for i in range(k)], out.sequences_scores.tolist()


def _assert_same(ours, ref_seqs: list[list[int]], ref_scores: list[float]) -> None:
    assert len(ours.outputs) == len(ref_seqs)
    for o, ref, score in zip(ours.outputs, ref_seqs, ref_scores, strict=True):
        assert o.token_ids == ref[: len(o.token_ids)]
        assert all(t == EOS for t in ref[len(o.token_ids) :])  # transformers pads a beam that ended early with EOS
        assert o.finish_reason == ("stop" if o.token_ids[-1] == EOS else "length")
        assert o.score == pytest.approx(score, abs=1e-4)
    scores = [o.score for o in ours.outputs]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.slow
@pytest.mark.parametrize(("k", "length_penalty"), [(2, 1.0), (4, 0.5)])
def test_fixed_length_beams_equal_transformers(smol_engine, smol_hf, chat_prompt_ids, k, length_penalty):
    n = 12
    params = SamplingParams(
        use_beam_search=True, n=k, temperature=0.0, max_tokens=n, ignore_eos=True, length_penalty=length_penalty
    )
    outs = smol_engine.generate(input_ids=chat_prompt_ids, sampling_params=params)  # the prompts share steps
    for prompt, ours in zip(chat_prompt_ids, outs, strict=True):
        assert [len(o.token_ids) for o in ours.outputs] == [n] * k
        assert all(EOS not in o.token_ids for o in ours.outputs)
        _assert_same(ours, *_hf_beams(smol_hf, prompt, k, n, length_penalty, ignore_eos=True))
    stats = smol_engine.manager.stats()
    assert (stats.in_use_blocks, stats.num_sequences) == (0, 0)  # every beam's blocks released
    smol_engine.manager.check_invariants()


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4])
def test_beams_that_end_on_eos_equal_transformers(smol_engine, smol_hf, chat_prompt_ids, k):
    prompt = chat_prompt_ids[0]  # "What is the capital of France? ...": every beam ends on EOS within 32 tokens
    params = SamplingParams(use_beam_search=True, n=k, temperature=0.0, max_tokens=32, length_penalty=1.0)
    ours = smol_engine.generate(input_ids=[prompt], sampling_params=params)[0]
    assert sum(o.finish_reason == "stop" for o in ours.outputs) == k
    assert len({len(o.token_ids) for o in ours.outputs}) > 1  # the hypotheses ended at different steps
    _assert_same(ours, *_hf_beams(smol_hf, prompt, k, 32, 1.0, ignore_eos=False))
    smol_engine.manager.check_invariants()


def test_best_candidates_order_and_float32_sums():
    offers = [TokenLogprobs(-0.5, [7, 3, 9], [-0.5, -1.0, float("-inf")]), TokenLogprobs(-0.1, [3, 4], [-0.1, -2.0])]
    got = best_candidates([-1.0, -1.4], offers, 4)
    assert [(c.beam, c.token) for c in got] == [(0, 7), (1, 3), (0, 3), (1, 4)]  # -1.5 ties -1.5: lower beam first
    assert got[0].score == f32(-1.5) and got[1].score == f32(f32(-1.4) + f32(-0.1))
    assert penalised(-3.0, 4, 0.5) == -1.5
    assert f32(1e39) == float("inf") and f32(0.1) != 0.1


@pytest.mark.parametrize(
    "bad",
    [
        {"n": 1},
        {"n": 17},
        {"temperature": 0.7},
        {"stop": ["x"]},
        {"stop_token_ids": [5]},
        {"logprobs": 1},
        {"repetition_penalty": 1.2},
        {"length_penalty": 11.0},
    ],
)
def test_beam_search_params_are_validated(bad):
    fields = {"use_beam_search": True, "n": 2, "temperature": 0.0, **bad}
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(**fields)
    assert SamplingParams(use_beam_search=True, n=16, temperature=0.0, length_penalty=-10.0).n == 16
