"""Structured outputs through the Engine on the tiny random Llama (float32): every constrained completion satisfies
its constraint whatever the weights, and the grammar state follows each sequence through n > 1, preemption by
recompute and by swap, abort, chunked prefill and prefix-cache hits, with unconstrained rows of the same batch
unchanged and every KV block and matcher given back."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from runtime.structured_outputs import InvalidStructuredOutputs, StructuredOutputs
from tests.runtime.engine_helpers import assert_idle, greedy, record_batches

REGEX = r"[a-z]{3}-[0-9]{2}( [a-z]{2,4}){3}"
CHOICES = ["red", "green", "light blue"]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["a", "b"]},
    },
    "required": ["ok", "n", "kind"],
    "additionalProperties": False,
}
PROMPTS = [list(range(5 + i, 40 + 3 * i)) for i in range(6)]  # 35..50 tokens: several blocks of 4


def params(so: StructuredOutputs, max_tokens: int = 64, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=max_tokens, structured_outputs=so, **kw)


REGEX_P = params(StructuredOutputs(regex=REGEX))
CHOICE_P = params(StructuredOutputs(choice=CHOICES))
JSON_P = params(StructuredOutputs(json=json.dumps(SCHEMA)))


@pytest.fixture(scope="module")
def make_engine(tiny_llama_dir):
    def make(**kw) -> Engine:
        kw.setdefault("num_blocks", 256)
        kw.setdefault("block_size", 4)
        kw.setdefault("dtype", "float32")
        return Engine(model=str(tiny_llama_dir), **kw)

    return make


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


@pytest.fixture(scope="module")
def solo(engine):
    """Each prompt alone with the regex, the choice and no constraint (12 tokens, ignore_eos)."""
    return {
        "regex": [engine.generate(input_ids=[p], sampling_params=REGEX_P)[0].text for p in PROMPTS],
        "choice": [engine.generate(input_ids=[p], sampling_params=CHOICE_P)[0].text for p in PROMPTS],
        "plain": [engine.generate(input_ids=[p], sampling_params=greedy(12))[0].token_ids for p in PROMPTS],
    }


def assert_no_matcher_left(engine: Engine) -> None:
    """After one more step (which carries the last finished sequences' drops to the worker) no matcher is left."""
    engine.generate(input_ids=[[1, 2, 3]], sampling_params=greedy(1))
    assert len(engine.runner.grammars) == 0


def check(out, kind: str) -> None:
    text = out.text
    assert out.finish_reason == "stop", (kind, text)
    if kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_mixed_batch_constrained_and_plain_rows(engine, solo):
    kinds = ["regex", "choice", "json", "plain", "regex", "plain"]
    by_kind = {"regex": REGEX_P, "choice": CHOICE_P, "json": JSON_P, "plain": greedy(12)}
    outs = engine.generate(input_ids=PROMPTS, sampling_params=[by_kind[k] for k in kinds])
    for i, (kind, out) in enumerate(zip(kinds, outs, strict=True)):
        if kind == "plain":
            assert out.token_ids == solo["plain"][i]  # an unconstrained row beside constrained ones is unchanged
        else:
            check(out, kind)
        if kind in ("regex", "choice"):
            assert out.text == solo[kind][i]  # batching changes no constrained greedy output
    assert_no_matcher_left(engine)
    assert_idle(engine)


def test_n_samples_each_with_its_own_matcher(engine):
    p = params(StructuredOutputs(regex=REGEX), temperature=1.0, seed=7, n=4)
    out = engine.generate(input_ids=[PROMPTS[0]], sampling_params=p)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    for o in out.outputs:
        assert o.finish_reason == "stop" and re.fullmatch(REGEX, o.text), o.text
    assert len({o.text for o in out.outputs}) > 1
    again = engine.generate(input_ids=[PROMPTS[0]], sampling_params=p)[0]
    assert [o.text for o in again.outputs] == [o.text for o in out.outputs]  # seeded: reproducible
    assert_idle(engine)


def test_max_tokens_too_small_ends_with_length(engine):
    out = engine.generate(input_ids=[PROMPTS[1]], sampling_params=params(StructuredOutputs(regex=REGEX), 3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_replays_the_matcher(make_engine, solo, mode):
    engine = make_engine(num_blocks=40, preemption_mode=mode, num_host_blocks=64 if mode == "swap" else 0)
    record_batches(engine)
    long_regex = StructuredOutputs(regex=r"([a-z]{4} ){12}[a-z]{4}")
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params(long_regex, 80))
    s = engine.stats()
    assert s.num_preemptions > 0 and (mode == "recompute" or s.num_swaps > 0)
    reference = make_engine(num_blocks=400)
    expected = reference.generate(input_ids=PROMPTS, sampling_params=params(long_regex, 80))
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert all(o.finish_reason == "stop" and re.fullmatch(r"([a-z]{4} ){12}[a-z]{4}", o.text) for o in outs)
    assert_no_matcher_left(engine)
    assert_idle(engine)


def test_abort_frees_the_matcher_and_blocks(engine):
    rids = [
        engine.add_request(input_ids=p, sampling_params=params(StructuredOutputs(regex="[a-z]{60}"), 80))
        for p in PROMPTS[:3]
    ]
    for _ in range(4):
        engine.step()
    assert len(engine.runner.grammars) == 3
    aborted = engine.abort(rids[1])
    assert aborted.finish_reason == "abort"
    while engine.scheduler.has_unfinished():
        engine.step()
    for r in (rids[0], rids[2]):
        out = engine.result(r)
        assert out.finish_reason == "stop" and re.fullmatch("[a-z]{60}", out.text)
    assert_no_matcher_left(engine)
    assert_idle(engine)


def test_chunked_prefill_and_prefix_hits(make_engine, solo):
    engine = make_engine(chunked_prefill_size=8, max_prefill_tokens=8)
    batches = record_batches(engine)
    first = engine.generate(input_ids=PROMPTS[:2], sampling_params=REGEX_P)
    assert [o.text for o in first] == solo["regex"][:2]
    assert sum(1 for b in batches for s in b.seqs if not s.sample) >= 4  # prompts ran in chunks that do not sample
    again = engine.generate(input_ids=PROMPTS[:2], sampling_params=REGEX_P)
    assert all(o.usage.cached_tokens > 0 for o in again)
    assert [o.text for o in again] == solo["regex"][:2]
    assert_idle(engine)


def test_a_constraint_that_does_not_compile_is_refused(engine):
    with pytest.raises(InvalidStructuredOutputs, match="structured_outputs.json does not compile"):
        engine.add_request(input_ids=PROMPTS[0], sampling_params=params(StructuredOutputs(json='{"type": 7}')))
    with pytest.raises(InvalidStructuredOutputs, match="structured_outputs.grammar does not compile"):
        engine.add_request(input_ids=PROMPTS[0], sampling_params=params(StructuredOutputs(grammar="root ::= x")))
    assert_idle(engine)
