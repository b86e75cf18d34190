"""The sampler's grammar stage (runtime/model/grammar/bitmask.py) against a plain torch reference, and the Sampler with
a token bitmask: greedy and sampled constrained rows pick only allowed tokens, unconstrained rows are untouched."""

from __future__ import annotations

import pytest
import torch

from runtime.model.grammar import GrammarRows, apply_token_bitmask
from runtime.model.sampler import Sampler, SampleRequest
from runtime.sampling_params import SamplingParams

V = 1000  # not a multiple of 32: the last word's high bits lie past the vocabulary


def reference(scores: torch.Tensor, rows: GrammarRows) -> torch.Tensor:
    """Unpack each int32 word's 32 bits (bit j of word w: token 32 * w + j), -inf where the bit is 0."""
    out = scores.clone()
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (rows.bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bits.shape[0], -1)[:, : scores.shape[-1]].bool()
    for j, i in enumerate(rows.batch_index.tolist()):
        out[i] = out[i].masked_fill(~allowed[j], float("-inf"))
    return out


def random_rows(batch_index: list[int], density: float, seed: int) -> GrammarRows:
    g = torch.Generator().manual_seed(seed)
    words = (V + 31) // 32
    allowed = torch.rand(len(batch_index), words * 32, generator=g) < density
    bits = allowed.reshape(len(batch_index), words, 32).to(torch.int64) << torch.arange(32)
    bitmask = bits.sum(-1).to(torch.int64)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)  # two's complement words
    return GrammarRows(torch.tensor(batch_index), bitmask, batch_index == list(range(6)))


@pytest.mark.parametrize("batch_index", [[1, 4], [0, 1, 2, 3, 4, 5], [5]])
@pytest.mark.parametrize("owned", [False, True])
def test_stage_equals_the_torch_reference(batch_index, owned):
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    rows = random_rows(batch_index, 0.3, seed=len(batch_index))
    before = logits.clone()
    expected = reference(logits, rows)
    out = apply_token_bitmask(logits, rows, owned=owned)
    assert torch.equal(out, expected)
    assert torch.isinf(out[batch_index]).sum() == int((expected[batch_index] == float("-inf")).sum()) > 0
    if not owned:
        assert torch.equal(logits, before)  # the raw logits stay for the logprobs


def test_none_costs_nothing():
    logits = torch.randn(3, V)
    assert apply_token_bitmask(logits, None) is logits


def test_sampler_picks_only_allowed_tokens_and_leaves_other_rows():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    allowed = [7, 300, 999]  # row 1 greedy, row 2 sampled: only these
    words = torch.zeros(2, (V + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[:, t // 32] |= 1 << (t % 32)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    rows = GrammarRows(torch.tensor([1, 2]), words)
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=5.0, seed=3)
    reqs = [
        SampleRequest(greedy, 0, 0),
        SampleRequest(greedy, 0, 0),
        SampleRequest(hot, 0, 0),
        SampleRequest(hot, 0, 0),
    ]
    sampler = Sampler(0)
    plain = sampler(logits, reqs)
    masked = sampler(logits, reqs, token_bitmask=rows)
    assert masked.token_ids[1] == max(allowed, key=lambda t: float(logits[1, t]))
    assert masked.token_ids[2] in allowed
    assert [masked.token_ids[0], masked.token_ids[3]] == [plain.token_ids[0], plain.token_ids[3]]
    for token_index in range(20):  # every draw of a hot row stays inside the allowed set
        reqs[2] = SampleRequest(hot, 0, token_index)
        assert sampler(logits, reqs, token_bitmask=rows).token_ids[2] in allowed


def test_logprobs_are_of_the_raw_logits():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    words = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    words[0, 0] = 1 << 5  # only token 5
    params = SamplingParams(temperature=0.0, logprobs=1)
    out = Sampler(0)(logits, [SampleRequest(params, 0, 0)], token_bitmask=GrammarRows(torch.tensor([0]), words, True))
    assert out.token_ids == [5]
    assert out.logprobs is not None and out.logprobs[0] is not None
    assert out.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[5]), abs=1e-6)
