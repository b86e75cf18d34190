"""Speculative decoding with structured outputs (issue 26) through the Engine on the loopy tiny Llama with the whole
SmolLM2 vocabulary (float32): each draft row is masked by the grammar's state after the draft tokens before it, so
every constrained output equals plain decoding's token for token (greedy and seeded), satisfies its constraint, and
ends on EOS where plain decoding does (right after an accepted run for "repeat"); no matcher or block is left behind.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from runtime.structured_outputs import StructuredOutputs
from tests.runtime.engine_helpers import assert_idle, greedy, record_batches
from tests.runtime.spec_helpers import NGRAM, PROMPTS, one_torch_thread, save_loopy_llama
from tests.runtime.test_engine_structured import REGEX, SCHEMA

REPEAT = r"(ab|cd)+x{3,9}"  # the loopy model repeats "ab" / "cd": long accepted runs, then EOS after the x's
CONSTRAINTS = {
    "json": StructuredOutputs(json=json.dumps(SCHEMA)),
    "regex": StructuredOutputs(regex=REGEX),
    "repeat": StructuredOutputs(regex=REPEAT),
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory, smollm2_tokenizer):
    """(plain, speculative) Engines on the loopy model with a 49152-token vocabulary, blocks of 4."""
    folder = save_loopy_llama(tmp_path_factory.mktemp("loopy_llama_49k"), smollm2_tokenizer, vocab_size=49152)

    def make(**kw) -> Engine:
        return Engine(model=str(folder), num_blocks=256, block_size=4, dtype="float32", **kw)

    with one_torch_thread():
        yield make(), make(speculative_config=NGRAM)


def _check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert re.fullmatch(REGEX if kind == "regex" else REPEAT, text), text


def _no_matcher_left(engine: Engine) -> None:
    engine.generate(input_ids=[[1, 2, 3]], sampling_params=greedy(1))  # carries the last drops to the worker
    assert len(engine.runner.grammars) == 0


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_constrained_equals_plain_decoding(engines, kind):
    plain, spec = engines
    params = SamplingParams(max_tokens=48, temperature=0.0, structured_outputs=CONSTRAINTS[kind])
    c = spec.scheduler.speculation.counters
    drafted, accepted = c.num_draft_tokens, c.num_accepted_tokens
    record_batches(spec)  # checks the manager's invariants after every step
    got = spec.generate(input_ids=PROMPTS, sampling_params=params)
    want = plain.generate(input_ids=PROMPTS, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert "stop" in [o.finish_reason for o in got]
    for out in got:
        if out.finish_reason == "stop":  # complete: EOS (inside an accepted run for "repeat")
            _check(kind, out.text)
    assert 0 < c.num_accepted_tokens - accepted < c.num_draft_tokens - drafted  # accepted and rejected drafts
    _no_matcher_left(spec)
    assert_idle(spec)


def test_seeded_constrained_with_penalties_and_logprobs_equals_plain_decoding(engines):
    plain, spec = engines
    params = [
        SamplingParams(max_tokens=48, temperature=0.3, seed=5, structured_outputs=CONSTRAINTS["repeat"], logprobs=2),
        SamplingParams(max_tokens=48, temperature=0.0, structured_outputs=CONSTRAINTS["json"], frequency_penalty=0.3),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),  # unconstrained beside them
    ]
    rids = [spec.add_request(input_ids=p, sampling_params=q) for p, q in zip(PROMPTS, params, strict=True)]
    while spec.scheduler.has_unfinished():
        spec.step()
    results = [spec.result(rid) for rid in rids]
    for got, prompt, q in zip(results, PROMPTS, params, strict=True):
        want = plain.generate(input_ids=[prompt], sampling_params=q)[0]
        assert got.token_ids == want.token_ids
        for a, b in zip(got.outputs[0].logprobs or [], want.outputs[0].logprobs or [], strict=True):
            assert a.top_token_ids == b.top_token_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert results[1].finish_reason == "stop"
    _check("json", results[1].text)
    _no_matcher_left(spec)
    assert_idle(spec)


ITEMS = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}}}}},
    "required": ["items"],
}


@pytest.mark.slow
def test_smollm2_json_copy_with_penalty_and_logprobs_equals_plain_decoding():
    data = {"items": [{"name": "alpha"}, {"name": "beta"}, {"name": "gamma"}, {"name": "delta"}]}
    messages = [{"role": "user", "content": "Repeat this JSON exactly: " + json.dumps(data)}]
    so = StructuredOutputs(json=json.dumps(ITEMS))
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so, frequency_penalty=0.1, logprobs=1)
    plain = Engine(dtype="float32", quantization="none")  # float32 weights: int4 rows would differ by row count
    want = plain.generate(messages=[messages], sampling_params=params)[0]
    # a verified row runs as an extend, not a decode: the gap between the two paths' float32 logprobs, measured by
    # scoring prompt + output as one extend (prompt_logprobs), bounds how far the logprobs may differ
    scored = plain.generate(
        input_ids=[want.prompt_token_ids + want.token_ids],
        sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=0),
    )[0]
    assert scored.prompt_logprobs is not None
    extend = [lp.logprob for lp in scored.prompt_logprobs.logprobs[-len(want.token_ids) :] if lp is not None]
    decode = [lp.logprob for lp in want.outputs[0].logprobs or []]
    tolerance = 2 * max(abs(a - b) for a, b in zip(extend, decode, strict=True)) + 1e-6
    spec = Engine(dtype="float32", quantization="none", speculative_config=NGRAM)
    got = spec.generate(messages=[messages], sampling_params=params)[0]
    assert got.token_ids == want.token_ids
    for a, b in zip(got.outputs[0].logprobs or [], want.outputs[0].logprobs or [], strict=True):
        assert a.top_token_ids == b.top_token_ids
        assert a.logprob == pytest.approx(b.logprob, abs=tolerance)
    assert spec.scheduler.speculation.counters.num_accepted_tokens > len(got.token_ids) // 3  # the copy is proposed
