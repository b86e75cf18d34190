"""The worker's verification of speculative drafts (runtime/model/spec_verify.py): the logits rows a step returns,
the seed index of each row, the accepted prefix, the drafts refused, and the distribution of the tokens it emits:
a chi-square test over 4000 seeds that the first token follows the target p (temperature and top-p applied) and the
bonus token after an accepted draft follows the next position's p, as plain sampling's would (Leviathan et al. 2023,
Chen et al. 2023)."""

from __future__ import annotations

import pytest
import torch

from runtime.model.sampler import Sampler, SampleRequest
from runtime.model.spec_verify import accept, draft_problem, logits_rows, row_token_indexes, sampled
from runtime.protocol import ScheduledSeq, TokenLogprobs
from runtime.sampling_params import SamplingParams
from runtime.structured_outputs import StructuredOutputs

GREEDY = SamplingParams(temperature=0.0)


def _seq(seq_id: int, tokens: list[int], start: int, drafts: int, sample: bool = True) -> ScheduledSeq:
    return ScheduledSeq(seq_id, tokens, start, [], sample, num_draft_tokens=drafts)


def test_logits_rows_cover_each_draft():
    prefill = _seq(1, [1, 2, 3, 4, 5], 0, 0, sample=False)
    plain = _seq(2, [7], 9, 0)
    drafted = _seq(3, [7, 8, 9], 4, 2)
    assert logits_rows([prefill, plain]) is None  # no draft: the model's own last-token rows
    assert logits_rows([prefill, plain, drafted]) == [5, 6, 7, 8]
    assert logits_rows([drafted, plain]) == [0, 1, 2, 3]


def test_row_token_indexes_are_plain_decodings():
    # prompt of 6, one token out (position 6): plain decoding draws completion token 1 next, then 2, 3
    assert list(row_token_indexes(_seq(1, [7, 8, 9], 6, 2), prompt_len=6)) == [1, 2, 3]
    assert list(row_token_indexes(_seq(1, [7], 6, 0), prompt_len=6)) == [1]


@pytest.mark.parametrize(
    ("drawn", "accepted", "token"),
    [([8, 9, 4], [8, 9], 4), ([8, 1, 4], [8], 1), ([3, 9, 4], [], 3), ([8, 9, 9], [8, 9], 9)],
)
def test_accept_takes_the_longest_matching_prefix(drawn, accepted, token):
    verified = accept(_seq(1, [7, 8, 9], 6, 2), drawn)
    assert (verified.accepted, verified.token) == (accepted, token)


def test_drafts_the_worker_refuses():
    s = _seq(1, [7, 8], 6, 1)
    assert draft_problem(s, GREEDY) is None
    assert "draft" in draft_problem(_seq(1, [7, 8], 6, 2), GREEDY)  # no token before the draft
    assert "sample" in draft_problem(_seq(1, [7, 8], 6, 1, sample=False), GREEDY)
    assert "beam" in draft_problem(s, SamplingParams(n=2, use_beam_search=True, temperature=0.0))
    for params in (
        SamplingParams(frequency_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(logprobs=1, logit_bias={3: 1.0}, min_tokens=4),
        SamplingParams(structured_outputs=StructuredOutputs(regex="a+")),
    ):
        assert draft_problem(s, params) is None  # each draft row gets them as plain decoding would


def _target(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The sampler's target distribution (temperature, then the smallest prefix reaching top_p), float64."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    mass_before = torch.cumsum(probs[order], dim=0) - probs[order]
    keep = order[mass_before < top_p]
    out = torch.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness-of-fit p-value over the categories of nonzero probability."""
    mask = probs > 0
    expected = probs[mask] * counts.sum()
    stat = ((counts[mask].double() - expected) ** 2 / expected).sum()
    df = int(mask.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2.0))


def test_emitted_tokens_follow_the_target_distribution():
    torch.manual_seed(0)
    vocab = 6
    logits = torch.randn(2, vocab) * 1.5  # row 0: the position of the draft; row 1: the bonus after it
    temperature = 0.8
    top_p = 0.9
    p0 = _target(logits[0], temperature, top_p)
    p1 = _target(logits[1], temperature, top_p)
    draft = int(torch.argsort(p0, descending=True)[1])  # the second most likely token: often rejected
    n = 4000
    rows = []
    for seed in range(n):
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
        rows += [SampleRequest(params, 0, 1), SampleRequest(params, 0, 2)]
    drawn = Sampler()(logits.repeat(n, 1), rows).token_ids
    firsts = torch.zeros(vocab, dtype=torch.int64)
    bonus = torch.zeros(vocab, dtype=torch.int64)
    for i in range(n):
        verified = accept(_seq(1, [5, draft], 6, 1), drawn[2 * i : 2 * i + 2])
        emitted = [*verified.accepted, verified.token]
        firsts[emitted[0]] += 1
        if verified.accepted:
            bonus[emitted[1]] += 1
    assert _chi_square_p(firsts, p0) > 1e-3
    assert _chi_square_p(bonus, p1) > 1e-3
    accepted = int(bonus.sum())
    sd = (n * p0[draft] * (1 - p0[draft])) ** 0.5
    assert abs(accepted - n * p0[draft]) < 4 * sd  # accepted with probability p(d)
    assert firsts[p0 == 0].sum() == 0 and bonus[p1 == 0].sum() == 0  # never outside top-p


def test_sampled_takes_each_emitted_tokens_row_logprobs():
    lps = [TokenLogprobs(-float(i), [t], [-float(i)]) for i, t in enumerate([8, 9, 4])]
    s = _seq(1, [7, 8, 9], 6, 2)
    got = sampled(s, [8, 1, 4], lps, asked=True)  # 8 stands, 1 replaces 9
    assert (got.accepted, got.token_id, got.accepted_logprobs, got.logprobs) == ([8], 1, [lps[0]], lps[1])
    assert got.emitted == [8, 1]
    assert sampled(s, [8, 1, 4], [None] * 3, asked=False).accepted_logprobs is None
    assert sampled(_seq(1, [7], 6, 0), [5], [lps[2]], asked=True) == (5, lps[2], None, None)  # no draft
