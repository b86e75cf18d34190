"""Stage 3 of the sampler: logit_bias added to the rows that ask, min_tokens masking EOS and stop ids until then, the
raw logits (and so the logprobs) untouched, and seeds anywhere in int64."""

from __future__ import annotations

import torch

from runtime.model.logit_bias import apply_logit_bias
from runtime.model.sampler import Sampler, SampleRequest, seeded_uniform
from runtime.sampling_params import SamplingParams

VOCAB = 32
EOS = 3


def _logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(7)) * 2.0


def test_bias_is_added_to_its_rows_only_and_the_input_is_not_changed():
    logits = _logits(3)
    before = logits.clone()
    rows = [
        SampleRequest(SamplingParams(logit_bias={5: 2.5, 9: -100.0}), 0, 0),
        SampleRequest(SamplingParams(), 0, 0),
        SampleRequest(SamplingParams(logit_bias={0: 1.0}), 0, 0),
    ]
    out = apply_logit_bias(logits, rows, [EOS])
    expected = before.clone()
    expected[0, 5] += 2.5
    expected[0, 9] -= 100.0
    expected[2, 0] += 1.0
    assert torch.equal(out, expected)
    assert torch.equal(logits, before)


def test_no_row_asking_returns_the_same_tensor():
    logits = _logits(2)
    rows = [SampleRequest(SamplingParams(), 0, 0), SampleRequest(SamplingParams(min_tokens=2), 0, 2)]
    assert apply_logit_bias(logits, rows, [EOS]) is logits


def test_plus_100_forces_a_token_and_minus_100_bans_the_greedy_one():
    logits = _logits(1)
    greedy = int(logits.argmax())
    second = int(logits[0].topk(2).indices[1])
    forced = (greedy + 11) % VOCAB
    sampler = Sampler(0, [EOS])
    force = SamplingParams(temperature=0.0, logit_bias={forced: 100.0})
    ban = SamplingParams(temperature=0.0, logit_bias={greedy: -100.0})
    assert sampler(logits, [SampleRequest(force, 0, 0)]).token_ids == [forced]
    assert sampler(logits, [SampleRequest(ban, 0, 0)]).token_ids == [second]
    # sampled rows see the bias too: +100 puts all the mass on the forced token
    hot = SamplingParams(temperature=1.0, seed=5, logit_bias={forced: 100.0})
    assert {sampler(logits, [SampleRequest(hot, 0, t)]).token_ids[0] for t in range(20)} == {forced}


def test_logprobs_are_those_of_the_raw_logits():
    logits = _logits(1)
    forced = (int(logits.argmax()) + 1) % VOCAB
    params = SamplingParams(temperature=0.0, logprobs=2, logit_bias={forced: 100.0})
    lp = Sampler(0)(logits, [SampleRequest(params, 0, 0)]).logprobs[0]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert lp.logprob == float(raw[forced])
    assert lp.top_token_ids == raw.topk(2).indices.tolist()


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 50.0  # EOS is the greedy token
    logits[0, 8] = 40.0  # then the stop id
    logits[0, 20] = 30.0
    sampler = Sampler(0, [EOS])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[8])
    picks = [sampler(logits, [SampleRequest(params, 0, t)]).token_ids[0] for t in range(5)]
    assert picks == [20, 20, 20, EOS, EOS]
    # ignore_eos: EOS is no ending id, so min_tokens leaves it alone (vLLM's rule); the stop id stays masked
    free = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[8], ignore_eos=True)
    assert sampler(logits, [SampleRequest(free, 0, 0)]).token_ids == [EOS]
    logits[0, EOS] = 0.0
    assert sampler(logits, [SampleRequest(free, 0, 0)]).token_ids == [20]
    # the mask beats a +100 bias
    pushed = SamplingParams(temperature=0.0, min_tokens=1, logit_bias={EOS: 100.0})
    assert sampler(logits, [SampleRequest(pushed, 0, 0)]).token_ids == [8]


def test_negative_and_large_seeds_are_reproducible_words():
    assert seeded_uniform(-1, 0, 4) == seeded_uniform(2**64 - 1, 0, 4)
    assert seeded_uniform(-(2**63), 0, 4) == seeded_uniform(2**63, 0, 4)
    assert seeded_uniform(-1, 0, 4) != seeded_uniform(1, 0, 4)
    logits = _logits(1)
    for seed in (-1, -(2**63), 2**63 - 1):
        params = SamplingParams(temperature=1.0, seed=seed)
        first = [Sampler(1)(logits, [SampleRequest(params, 0, t)]).token_ids[0] for t in range(16)]
        again = [Sampler(2)(logits, [SampleRequest(params, 0, t)]).token_ids[0] for t in range(16)]
        assert first == again
