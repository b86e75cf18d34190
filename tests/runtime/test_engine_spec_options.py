"""Speculative decoding with every sampling option (issue 26) through the Engine on the tiny loopy Llama (float32):
penalties, logit_bias, min_tokens and logprobs run drafts, and every output equals plain decoding's token for token
(greedy and seeded sampling), with logprobs equal to plain decoding's; drafts are both accepted and rejected, and
every block comes back."""

from __future__ import annotations

import pytest

from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from tests.runtime.engine_helpers import assert_idle, greedy, record_batches
from tests.runtime.spec_helpers import NGRAM, PROMPTS, one_torch_thread, save_loopy_llama

EOS = 2
OPTIONS = {
    "frequency": {"frequency_penalty": 0.4},
    "presence": {"presence_penalty": 0.6},
    "repetition": {"repetition_penalty": 1.3},
    "all_penalties": {"frequency_penalty": 0.2, "presence_penalty": 0.2, "repetition_penalty": 1.1},
    "logit_bias": {"logit_bias": {5: 1.0, 6: -3.0}},
    "logprobs": {"logprobs": 3},
    "penalties_and_logprobs": {"frequency_penalty": 0.3, "logprobs": 2},
}
# sampled at temperature 0.3: the loopy model's draws still repeat enough for drafts to be accepted
SEEDED = {
    "frequency": {"frequency_penalty": 0.1},
    "all_penalties": {"frequency_penalty": 0.05, "presence_penalty": 0.05, "repetition_penalty": 1.05},
    "logit_bias": {"logit_bias": {5: 1.0, 6: -3.0}},
    "penalties_and_logprobs": {"frequency_penalty": 0.1, "logprobs": 2},
}


@pytest.fixture(scope="module")
def loopy_dir(tmp_path_factory, smollm2_tokenizer):
    return save_loopy_llama(tmp_path_factory.mktemp("loopy_llama"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def engines(loopy_dir):
    """(plain, speculative) Engines on the loopy model, blocks of 4 so runs cross block boundaries."""

    def make(**kw) -> Engine:
        return Engine(model=str(loopy_dir), num_blocks=128, block_size=4, dtype="float32", **kw)

    with one_torch_thread():
        yield make(), make(speculative_config=NGRAM)


def _run(engine: Engine, params: SamplingParams, prompts=PROMPTS):
    return engine.generate(input_ids=prompts, sampling_params=params)


def _assert_same(got, want) -> None:
    """Same tokens and finish reasons; logprobs (the sampled token's and the top ids / values) within 1e-5."""
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    for g, w in zip(got, want, strict=True):
        assert (g.outputs[0].logprobs is None) == (w.outputs[0].logprobs is None)
        for a, b in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or [], strict=True):
            assert a.top_token_ids == b.top_token_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-5)


def _counters(engine: Engine) -> tuple[int, int]:
    c = engine.scheduler.speculation.counters
    return c.num_draft_tokens, c.num_accepted_tokens


@pytest.mark.parametrize("option", list(OPTIONS))
def test_greedy_with_option_equals_plain_decoding(engines, option):
    plain, spec = engines
    params = greedy(32, **OPTIONS[option])
    drafted, accepted = _counters(spec)
    record_batches(spec)  # checks the manager's invariants after every step
    got = _run(spec, params)
    _assert_same(got, _run(plain, params))
    drafted2, accepted2 = _counters(spec)
    assert 0 < accepted2 - accepted < drafted2 - drafted  # drafts both accepted and rejected
    if "logprobs" in OPTIONS[option]:
        assert [len(o.outputs[0].logprobs or []) for o in got] == [32] * len(PROMPTS)
    assert_idle(spec)


def test_min_tokens_cuts_inside_accepted_runs(engines):
    """EOS pushed up by logit_bias and masked until min_tokens: the first EOS comes where plain decoding's does."""
    plain, spec = engines
    params = SamplingParams(max_tokens=40, temperature=0.0, min_tokens=9, logit_bias={EOS: 6.0}, logprobs=1)
    want = _run(plain, params)
    assert [o.finish_reason for o in want] == ["stop"] * 3 and min(len(o.token_ids) for o in want) == 10
    _assert_same(_run(spec, params), want)
    assert_idle(spec)


@pytest.mark.parametrize("option", list(SEEDED))
def test_seeded_sampling_with_option_equals_plain_decoding(engines, option):
    plain, spec = engines
    params = SamplingParams(max_tokens=24, temperature=0.3, top_p=0.9, seed=11, ignore_eos=True, **SEEDED[option])
    drafted, accepted = _counters(spec)
    _assert_same(_run(spec, params), _run(plain, params))
    assert _counters(spec)[1] > accepted
    assert_idle(spec)


def test_mixed_batch_of_options(engines):
    """One step verifies drafts of sequences with and without penalties and logprobs side by side."""
    plain, spec = engines
    params = [greedy(24), greedy(24, frequency_penalty=0.5), greedy(24, logprobs=1)]
    batches = record_batches(spec)
    rids = [spec.add_request(input_ids=p, sampling_params=q) for p, q in zip(PROMPTS, params, strict=True)]
    while spec.scheduler.has_unfinished():
        spec.step()
    for rid, prompt, q in zip(rids, PROMPTS, params, strict=True):
        _assert_same([spec.result(rid)], _run(plain, q, [prompt]))
    mixed = [b for b in batches if sum(1 for s in b.seqs if s.num_draft_tokens) >= 2]
    assert mixed
    assert_idle(spec)
