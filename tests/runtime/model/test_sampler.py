"""The batched sampler: greedy, seeds independent of the batch, top-k / top-p / min-p sets, parameter validation."""

from __future__ import annotations

import pytest
import torch

from runtime.model.sampler import Sampler, SampleRequest, seeded_uniform
from runtime.sampling_params import InvalidSamplingParams, SamplingParams

VOCAB = 64


def _logits(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3.0


def test_temperature_zero_is_argmax():
    logits = _logits(0, rows=5)
    rows = [SampleRequest(SamplingParams(temperature=0.0, seed=i), 0, i) for i in range(5)]
    assert Sampler(0)(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_seeded_draws_do_not_depend_on_batch_composition():
    target = _logits(1)[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = [Sampler(0)(target[None], [SampleRequest(params, 2, t)]).token_ids[0] for t in range(40)]
    batched = []
    for t in range(40):
        others = _logits(100 + t, rows=3)
        logits = torch.cat([others[:2], target[None], others[2:]])
        rows = [
            SampleRequest(SamplingParams(temperature=0.7), 0, t),
            SampleRequest(SamplingParams(seed=9), 0, t),
            SampleRequest(params, 2, t),
            SampleRequest(SamplingParams(temperature=0.0), 0, 0),
        ]
        batched.append(Sampler(t)(logits, rows).token_ids[2])
    assert batched == alone
    assert len(set(alone)) > 1  # the draws do vary with the token index
    other_sample = [Sampler(0)(target[None], [SampleRequest(params, 3, t)]).token_ids[0] for t in range(40)]
    assert other_sample != alone


def test_seeded_uniform_is_a_pure_function():
    assert seeded_uniform(5, 0, 7) == seeded_uniform(5, 0, 7)
    values = {seeded_uniform(5, 0, t) for t in range(1000)}
    assert len(values) == 1000 and all(0.0 <= v < 1.0 for v in values)


def _draws(logits: torch.Tensor, params: SamplingParams, n: int = 400) -> set[int]:
    sampler = Sampler(0)
    rows = [SampleRequest(params, 0, t) for t in range(n)]
    return set(sampler(logits.expand(n, -1).contiguous(), rows).token_ids)


def test_top_k_never_samples_outside_the_k_best():
    logits = _logits(2)[0]
    allowed = set(logits.topk(5).indices.tolist())
    drawn = _draws(logits, SamplingParams(temperature=5.0, top_k=5, seed=1))
    assert drawn <= allowed and len(drawn) >= 2


def test_top_p_never_samples_outside_the_nucleus():
    logits = _logits(3)[0]
    probs = torch.softmax(logits / 2.0, dim=-1)
    sorted_p, order = probs.sort(descending=True)
    size = int(((sorted_p.cumsum(0) - sorted_p) < 0.6).sum())  # smallest prefix whose mass reaches 0.6
    allowed = set(order[:size].tolist())
    drawn = _draws(logits, SamplingParams(temperature=2.0, top_p=0.6, seed=2))
    assert drawn <= allowed and len(drawn) >= 2


def test_min_p_never_samples_below_the_threshold():
    logits = _logits(4)[0]
    probs = torch.softmax(logits / 3.0, dim=-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    drawn = _draws(logits, SamplingParams(temperature=3.0, min_p=0.2, seed=3))
    assert drawn <= allowed and len(drawn) >= 2


def test_filters_combine_and_unseeded_rows_follow_the_sampler_seed():
    logits = _logits(5)[0]
    params = SamplingParams(temperature=1.5, top_k=10, top_p=0.9, min_p=0.05)
    drawn_a = Sampler(7)(logits.expand(50, -1).contiguous(), [SampleRequest(params, 0, 0)] * 50).token_ids
    drawn_b = Sampler(7)(logits.expand(50, -1).contiguous(), [SampleRequest(params, 0, 0)] * 50).token_ids
    assert drawn_a == drawn_b
    assert set(drawn_a) <= set(logits.topk(10).indices.tolist())


def test_logprobs_of_sampled_token_and_top_alternatives():
    logits = _logits(6, rows=2)
    rows = [
        SampleRequest(SamplingParams(temperature=0.0, logprobs=3), 0, 0),
        SampleRequest(SamplingParams(temperature=0.0), 0, 0),
    ]
    out = Sampler(0)(logits, rows)
    lp = torch.log_softmax(logits[0], dim=-1)
    first = out.logprobs[0]
    assert out.logprobs[1] is None
    assert first.top_token_ids == lp.topk(3).indices.tolist()
    assert first.top_token_ids[0] == out.token_ids[0]
    assert first.logprob == pytest.approx(float(lp.max()))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_k": -2},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"min_p": 1.1},
        {"max_tokens": 0},
        {"n": 0},
        {"logprobs": 21},
        {"seed": -(2**63) - 1},
        {"stop": [""]},
        {"stop_token_ids": [-1]},
    ],
)
def test_invalid_params_raise(kwargs):
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(**kwargs)


def test_row_count_mismatch_raises():
    with pytest.raises(ValueError, match="2 logits rows for 1"):
        Sampler(0)(_logits(0, rows=2), [SampleRequest(SamplingParams(), 0, 0)])


def test_tiny_temperatures_give_the_greedy_tokens():
    """Below 1e-5 the sampler takes the argmax instead of dividing: logits / 1e-38 or 1e-45 in float32 are inf/nan
    and the draw returned junk tokens."""
    logits = _logits(7, rows=8)
    for temperature in (1e-30, 1e-38, 1e-45, 9e-6):
        rows = [SampleRequest(SamplingParams(temperature=temperature, seed=i), 0, i) for i in range(8)]
        assert Sampler(0)(logits, rows).token_ids == logits.argmax(dim=-1).tolist(), temperature


def test_logprobs_and_top_k_are_clamped_to_a_small_vocabulary():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    greedy = SampleRequest(SamplingParams(temperature=0.0, logprobs=20), 0, 0)
    out = Sampler(0)(logits, [greedy])
    assert out.token_ids == [1] and out.logprobs[0].top_token_ids == [1, 3, 2, 0]
    top_k = SampleRequest(SamplingParams(temperature=1.0, top_k=2**31 - 1, seed=5), 0, 0)
    assert (
        Sampler(0)(logits, [top_k]).token_ids
        == Sampler(0)(logits, [top_k._replace(params=SamplingParams(temperature=1.0, top_k=-1, seed=5))]).token_ids
    )
