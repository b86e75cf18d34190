"""The worker's per-row state for a speculative draft (issue 26): row j of a draft d_1..d_k sees the penalties and the
grammar mask plain decoding would have after d_1..d_j-1 (PenaltyState.rows' and GrammarState.rows' prior), and
neither state changes until the accepted tokens are recorded."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.model.grammar import GrammarCache, GrammarState, apply_token_bitmask
from runtime.model.penalties import PenaltyState
from runtime.model.spec_verify import row_priors
from runtime.protocol import ScheduledSeq
from runtime.sampling_params import SamplingParams
from runtime.structured_outputs import StructuredOutputs
from tests.runtime.model.test_penalties import LOGITS, _reference

CPU = torch.device("cpu")
VOCAB = 49152
EOS = 2


def test_row_priors_grow_by_one_draft_token():
    s = ScheduledSeq(1, [7, 8, 9, 4], 6, [], True, num_draft_tokens=3)
    assert row_priors(s) == [[], [8], [8, 9], [8, 9, 4]]
    assert row_priors(ScheduledSeq(1, [7], 6, [], True)) == [[]]


def test_penalty_rows_count_the_draft_tokens_before_each_row():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0)
    state = PenaltyState(6, CPU)
    state.add(1, params, [4], [0, 3])
    logits = torch.tensor([LOGITS[0]] * 4 + [LOGITS[1]])
    prior = [[], [3], [3, 5], [3, 5, 5], []]  # seq 1 verifies the draft [3, 5, 5]; seq 9 has no state
    rows = state.rows([1, 1, 1, 1, 9], prior)
    assert rows is not None
    out = rows.apply(logits)
    for j in range(4):
        want = _reference(LOGITS[0], [4], [0, 3, *prior[j]], 0.5, 0.25, 2.0)
        assert out[j].tolist() == want
    assert out[4].tolist() == LOGITS[1]
    assert state.counts[state._rows[1]].tolist() == [1, 0, 0, 1, 0, 0]  # the state itself is unchanged
    state.record([1, 1], [3, 5])  # two tokens of one step: an accepted draft token, then the token after it
    assert state.counts[state._rows[1]].tolist() == [1, 0, 0, 2, 0, 1]


SO = StructuredOutputs(json=json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))


@pytest.fixture(scope="module")
def cache(smollm2_tokenizer):
    return GrammarCache(smollm2_tokenizer, VOCAB, [EOS])


def _allowed(state: GrammarState, seq_ids: list[int], prior=None) -> list[set[int]]:
    rows = state.rows(seq_ids, prior)
    assert rows is not None
    out = apply_token_bitmask(torch.zeros(len(seq_ids), VOCAB), rows)
    return [set(torch.nonzero(out[r] == 0).flatten().tolist()) for r in range(len(seq_ids))]


def test_grammar_rows_follow_the_draft_and_leave_the_matcher(cache, smollm2_tokenizer):
    draft = smollm2_tokenizer.encode('{"n": 12}', add_special_tokens=False) + [EOS]
    state = GrammarState(lambda: cache, VOCAB, CPU)
    state.add(1, SO, [])
    state.add(2, SO, [])
    priors = [draft[:j] for j in range(len(draft) + 1)]
    got = _allowed(state, [1] * len(priors) + [2], [*priors, []])
    # plain decoding's masks, one token at a time on seq 2
    for j, token in enumerate(draft):
        assert got[j] == _allowed(state, [2])[0]
        assert token in got[j]
        assert state.record([2], [token]) == {}
    assert got[len(draft)] == got[len(draft) - 1]  # after EOS (the grammar ended): the row before's mask
    assert got[-1] == got[0]  # seq 1's matcher went back to where it was, and seq 2 started there
    assert state.record([1] * len(draft) + [1], [*draft, 7]) == {}  # after EOS the rest is not fed


def test_a_draft_token_the_grammar_rejects_ends_the_draft(cache, smollm2_tokenizer):
    state = GrammarState(lambda: cache, VOCAB, CPU)
    state.add(1, SO, [])
    good = smollm2_tokenizer.encode('{"', add_special_tokens=False)
    bad = smollm2_tokenizer.encode("x", add_special_tokens=False)[0]
    draft = [*good, bad, good[0]]
    got = _allowed(state, [1] * (len(draft) + 1), [draft[:j] for j in range(len(draft) + 1)])
    assert bad not in got[len(good)]  # its row cannot draw it: verification ends there
    assert got[len(good) + 1] == got[len(good) + 2] == got[len(good)]
    assert _allowed(state, [1])[0] == got[0]  # rolled back
    rejected = state.record([1] * (len(good) + 2), [*good, bad, good[0]])
    assert list(rejected) == [1]  # a token the grammar rejects fails the sequence; the ones after are skipped
