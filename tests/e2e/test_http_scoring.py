"""Scoring and the sampling extras over HTTP, through the real openai SDK, against transformers' float32 forward of
the tiny random Llama behind the server: lm-evaluation-harness's loglikelihood request (echo, max_tokens 0,
logprobs 1), vLLM's prompt_logprobs, echo with a generated continuation, logit_bias forcing and banning a token,
min_tokens, and int64 seeds."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.e2e.http_servers import MODEL, assert_idle, salt

TEXT = "The quick brown fox jumps over the lazy dog because it"
IDS = [504, 3125, 314, 260, 1345, 28, 8, 19, 477, 33, 4451]
TOL = 1e-4  # float32 logits of this model against transformers' (tests/runtime/model/test_runner.py's bound)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_dir):
    """ids -> transformers' float32 log-softmax at every position of ids: [len(ids), vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


def test_lm_eval_loglikelihood_request(oai, zmq, wait_idle, smollm2_tokenizer, hf_logprobs):
    ids = smollm2_tokenizer(TEXT).input_ids
    ref = hf_logprobs(ids)
    r = oai.completions.create(
        model=MODEL, prompt=TEXT, echo=True, max_tokens=0, logprobs=1, extra_body={"cache_salt": salt()}
    )
    c = r.choices[0]
    assert (c.text, c.finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens) == (TEXT, "length", len(ids), 0)
    lp = c.logprobs
    assert lp.tokens == [smollm2_tokenizer.decode([t]) for t in ids]
    assert (lp.token_logprobs[0], lp.top_logprobs[0], lp.text_offset[0]) == (None, None, 0)
    for pos in range(1, len(ids)):
        assert abs(lp.token_logprobs[pos] - float(ref[pos - 1, ids[pos]])) <= TOL, pos
        best = int(ref[pos - 1].argmax())
        assert abs(lp.top_logprobs[pos][smollm2_tokenizer.decode([best])] - float(ref[pos - 1, best])) <= TOL
        assert lp.text_offset[pos] == lp.text_offset[pos - 1] + len(lp.tokens[pos - 1])
    assert_idle(zmq, wait_idle)


def test_prompt_logprobs_extra_and_echo_with_a_continuation(oai, zmq, wait_idle, smollm2_tokenizer, hf_logprobs):
    ref = hf_logprobs(IDS)
    greedy = zmq.generate(input_ids=IDS, max_tokens=3, temperature=0.0, cache_salt=salt())
    r = oai.completions.create(
        model=MODEL,
        prompt=IDS,
        echo=True,
        max_tokens=3,
        temperature=0.0,
        logprobs=2,
        extra_body={"prompt_logprobs": 1, "cache_salt": salt()},
    )
    c = r.choices[0]
    prompt_text = smollm2_tokenizer.decode(IDS)
    assert c.text == prompt_text + greedy.text
    assert len(c.logprobs.tokens) == len(IDS) + 3
    assert c.logprobs.text_offset[len(IDS)] == len(prompt_text)
    prompt_lp = c.model_extra["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == len(IDS)
    for pos in range(1, len(IDS)):
        row = ref[pos - 1]
        entry = prompt_lp[pos]
        mine = entry[str(IDS[pos])]
        assert abs(mine["logprob"] - float(row[IDS[pos]])) <= TOL
        assert int((row > mine["logprob"] + TOL).sum()) + 1 <= mine["rank"] <= int((row > mine["logprob"] - TOL).sum())
        assert mine["decoded_token"] == smollm2_tokenizer.decode([IDS[pos]])
        best = int(row.argmax())
        assert entry[str(best)]["rank"] == 1 and abs(entry[str(best)]["logprob"] - float(row[best])) <= TOL
        assert len(entry) == (1 if best == IDS[pos] else 2)
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0, "cache_salt": salt()},
    )
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    assert_idle(zmq, wait_idle)


def test_logit_bias_forces_and_bans_tokens(oai, zmq, wait_idle, smollm2_tokenizer):
    ref = zmq.generate(input_ids=IDS, max_tokens=1, temperature=0.0, logprobs=2, cache_salt=salt())
    greedy, second = ref.choices[0].logprobs[0].top_token_ids
    banned = oai.completions.create(
        model=MODEL, prompt=IDS, max_tokens=1, temperature=0.0, logit_bias={str(greedy): -100}
    )
    assert banned.choices[0].text == smollm2_tokenizer.decode([second])
    forced_id = 1345
    forced = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "anything"}],
        max_tokens=3,
        temperature=0.9,
        seed=-(2**63),
        logit_bias={str(forced_id): 100},
    )
    assert forced.choices[0].message.content == smollm2_tokenizer.decode([forced_id] * 3)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt=IDS, max_tokens=1, logit_bias={"49152": 5})
    assert info.value.param == "logit_bias"
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt=IDS, max_tokens=1, logit_bias={"7": 101})
    assert info.value.param.startswith("logit_bias")
    assert_idle(zmq, wait_idle)


def test_min_tokens_holds_the_stop_id_back(oai, zmq, wait_idle):
    ref = zmq.generate(input_ids=IDS, max_tokens=6, temperature=0.0, cache_salt=salt())
    stop_id = ref.token_ids[1]
    early = oai.completions.create(
        model=MODEL, prompt=IDS, max_tokens=6, temperature=0.0, extra_body={"stop_token_ids": [stop_id]}
    )
    assert (early.usage.completion_tokens, early.choices[0].finish_reason) == (ref.token_ids.index(stop_id) + 1, "stop")
    held = zmq.generate(
        input_ids=IDS, max_tokens=6, temperature=0.0, stop_token_ids=[stop_id], min_tokens=4, cache_salt=salt()
    )
    # the same tokens as banning the stop id for 4 tokens, then going on from there as usual
    first = zmq.generate(input_ids=IDS, max_tokens=4, temperature=0.0, logit_bias={stop_id: -100.0}, cache_salt=salt())
    rest = zmq.generate(
        input_ids=IDS + first.token_ids, max_tokens=2, temperature=0.0, stop_token_ids=[stop_id], cache_salt=salt()
    )
    assert stop_id not in first.token_ids
    assert held.token_ids == first.token_ids + rest.token_ids
    assert held.finish_reason == rest.finish_reason
    r = oai.completions.create(
        model=MODEL,
        prompt=IDS,
        max_tokens=6,
        temperature=0.0,
        extra_body={"stop_token_ids": [stop_id], "min_tokens": 4, "cache_salt": salt()},
    )
    assert r.usage.completion_tokens == len(held.token_ids)
    assert_idle(zmq, wait_idle)


def test_negative_and_large_seeds_are_reproducible(oai):
    for seed in (-1, -(2**63), 2**63 - 1):
        texts = {
            oai.completions.create(model=MODEL, prompt=IDS, max_tokens=8, temperature=1.0, seed=seed).choices[0].text
            for _ in range(2)
        }
        assert len(texts) == 1
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt=IDS, max_tokens=1, seed=2**63)
    assert info.value.param == "seed"


def test_streamed_echo_equals_non_streamed(oai, zmq, wait_idle):
    kwargs = dict(model=MODEL, prompt=IDS, echo=True, max_tokens=4, temperature=0.0, logprobs=1)
    full = oai.completions.create(**kwargs, extra_body={"prompt_logprobs": 2, "cache_salt": salt()}).choices[0]
    chunks = list(
        oai.completions.create(**kwargs, stream=True, extra_body={"prompt_logprobs": 2, "cache_salt": salt()})
    )
    choices = [ch.choices[0] for ch in chunks]
    assert "".join(c.text for c in choices) == full.text
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        streamed = [v for c in choices if c.logprobs is not None for v in getattr(c.logprobs, key)]
        assert streamed == getattr(full.logprobs, key), key
    assert choices[0].model_extra["prompt_logprobs"] == full.model_extra["prompt_logprobs"]
    assert all("prompt_logprobs" not in c.model_extra for c in choices[1:])
    assert (choices[-1].finish_reason, full.finish_reason) == ("length", "length")
    scored = list(oai.completions.create(model=MODEL, prompt=IDS, echo=True, max_tokens=0, logprobs=0, stream=True))
    assert "".join(ch.choices[0].text for ch in scored) == zmq.detokenize(IDS)
    assert_idle(zmq, wait_idle)
