"""The issue 26 chi-square test: under speculative decoding the emitted tokens follow plain sampling's distribution,
with top-p and with penalties, on a tiny random Llama (float32) run by the worker (ModelRunner.execute over
hand-built ForwardBatches: no scheduler, so thousands of sequences take seconds).

Each of N sequences (unseeded: the sampler's generator, seeded by ServerArgs.seed, so the test is deterministic)
samples x1 after a fixed prompt; the next step verifies a forced one-token draft d (the token x2 most often is, so
it is sometimes right and often wrong): row 0 draws x2 (d stands when x2 == d), row 1 draws the bonus x3 after d with
the penalties counting d; a rejected draft's x3 comes from a plain decode step. The joint (x2, x3) must follow
sum_x1 p(x1) p(x2 | x1) p(x3 | x1, x2), the targets computed in float64 from transformers' logits with the
penalties, temperature and top-p written out here (runtime/model/penalties.py, sampler.py). A reference that
ignores the penalties is rejected by the same test (it has power)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from runtime.config import ServerArgs
from runtime.model.runner import ModelRunner
from runtime.protocol import ForwardBatch, ScheduledSeq
from runtime.sampling_params import SamplingParams
from tests.runtime.spec_helpers import one_torch_thread

N = 3000
VOCAB = 64
PROMPT = [5, 9, 13, 7]  # one block of 4
TOP_P = 0.9
CASES = {
    "top_p": SamplingParams(max_tokens=3, temperature=1.0, top_p=TOP_P, ignore_eos=True),
    "top_p_and_penalties": SamplingParams(
        max_tokens=3,
        temperature=1.0,
        top_p=TOP_P,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        repetition_penalty=1.2,
        ignore_eos=True,
    ),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_tokenizer):
    """A 1-layer Llama with a 64-token vocabulary whose next-token distributions keep a few tokens under top-p."""
    from tests.conftest import _save_tiny

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=1.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    return _save_tiny(tmp_path_factory.mktemp("chi_llama"), config, smollm2_tokenizer, seed=5)


def _target(logits: torch.Tensor, output: list[int], params: SamplingParams) -> torch.Tensor:
    """float64 [V]: the sampler's distribution for raw logits float32 [V] after output (penalties as penalties.py:
    repetition on prompt + output tokens, then frequency and presence on output counts; temperature; the smallest
    prefix of the sorted probabilities reaching top_p). Asserts no token sits within 1e-4 of the top-p cut, so
    float32 rounding in the sampler cannot move it."""
    x = logits.double().clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=VOCAB).double()
    seen = (counts > 0) | torch.isin(torch.arange(VOCAB), torch.tensor(PROMPT))
    r = params.repetition_penalty
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()
    probs = torch.softmax(x / params.temperature, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True)
    before = torch.cumsum(probs[order], dim=0) - probs[order]
    assert (before - params.top_p).abs().min() > 1e-4
    keep = order[before < params.top_p]
    out = torch.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


def _joint(folder, params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(x2, x3) = sum_x1 p(x1) p(x2 | x1) p(x3 | x1, x2) from transformers' float32 logits."""
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)

    def last_logits(seqs: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor(seqs)).logits[:, -1]

    p1 = _target(last_logits([PROMPT])[0], [], params)
    firsts = torch.nonzero(p1).flatten().tolist()
    l2 = last_logits([PROMPT + [a] for a in firsts])
    joint: Counter[tuple[int, int]] = Counter()
    for a, row in zip(firsts, l2, strict=True):
        p2 = _target(row, [a], params)
        seconds = torch.nonzero(p2).flatten().tolist()
        l3 = last_logits([PROMPT + [a, b] for b in seconds])
        for b, row3 in zip(seconds, l3, strict=True):
            p3 = _target(row3, [a, b], params)
            for c in torch.nonzero(p3).flatten().tolist():
                joint[(b, c)] += float(p1[a] * p2[b] * p3[c])
    return dict(joint)


def _run(folder, params: SamplingParams, draft: int) -> tuple[Counter[tuple[int, int]], int]:
    """The (x2, x3) counts of N sequences verifying the draft [draft] at their second step, and how many accepted."""
    runner = ModelRunner(ServerArgs(model=str(folder), num_blocks=2 * N + 1, block_size=4, dtype="float32", seed=7))
    penalty_ids = list(PROMPT) if params.repetition_penalty != 1.0 else []
    prefill = [
        ScheduledSeq(i, list(PROMPT), 0, [1 + 2 * i], True, params, len(PROMPT), 0, penalty_ids) for i in range(N)
    ]
    r1 = runner.execute(ForwardBatch(1, prefill))
    x1 = dict(zip(r1.seq_ids, r1.token_ids, strict=True))
    verify = [ScheduledSeq(i, [x1[i], draft], 4, [2 + 2 * i], True, num_draft_tokens=1) for i in range(N)]
    r2 = runner.execute(ForwardBatch(2, verify))
    accepted = r2.accepted_token_ids or {}
    x2 = dict(zip(r2.seq_ids, r2.token_ids, strict=True))
    pairs: Counter[tuple[int, int]] = Counter()
    rejected = [i for i in range(N) if not accepted[i]]
    for i in range(N):
        if accepted[i]:
            pairs[(draft, x2[i])] += 1
    r3 = runner.execute(ForwardBatch(3, [ScheduledSeq(i, [x2[i]], 5, [], True) for i in rejected]))
    for i, x3 in zip(r3.seq_ids, r3.token_ids, strict=True):
        pairs[(x2[i], x3)] += 1
    assert not r1.failed_seq_ids and not r2.failed_seq_ids and not r3.failed_seq_ids
    return pairs, N - len(rejected)


def _chi_square_p(counts: Counter[tuple[int, int]], probs: dict[tuple[int, int], float]) -> float:
    """Pearson's chi-square p-value of counts against probs, the cells of expected count below 5 pooled into one.
    A count outside the support of probs gives 0.0."""
    if set(counts) - set(probs):
        return 0.0
    n = sum(counts.values())
    big = [k for k, q in probs.items() if q * n >= 5]
    small = [k for k in probs if k not in big]
    observed = [counts[k] for k in big] + [sum(counts[k] for k in small)]
    expected = [probs[k] * n for k in big] + [sum(probs[k] for k in small) * n]
    if expected[-1] < 5:  # fold a tiny pooled cell into the last big one
        observed[-2] += observed.pop()
        expected[-2] += expected.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    df = torch.tensor((len(observed) - 1) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_tokens_follow_plain_sampling(folder, case):
    params = CASES[case]
    joint = _joint(folder, params)
    marginal: Counter[int] = Counter()
    for (b, _), q in joint.items():
        marginal[b] += q
    draft = max(marginal, key=marginal.__getitem__)
    assert 0.2 < marginal[draft] < 0.8  # the draft is right sometimes and wrong sometimes
    with one_torch_thread():
        pairs, accepted = _run(folder, params, draft)
    assert abs(accepted - N * marginal[draft]) < 4 * (N * marginal[draft] * (1 - marginal[draft])) ** 0.5
    assert len(joint) >= 4
    assert _chi_square_p(pairs, joint) > 1e-3
    if params.has_penalties:  # the same counts against the target without penalties: rejected
        plain = SamplingParams(max_tokens=3, temperature=1.0, top_p=TOP_P, ignore_eos=True)
        assert _chi_square_p(pairs, _joint(folder, plain)) < 1e-6
