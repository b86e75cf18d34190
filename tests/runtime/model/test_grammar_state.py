"""GrammarCache and GrammarState (runtime/model/grammar/) on the SmolLM2 vocabulary: the cache, the replay after a
re-registration, rejected tokens, and the errors of a constraint that does not compile."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.model.grammar import GrammarCache, GrammarState, apply_token_bitmask
from runtime.structured_outputs import NO_TOKEN, InvalidStructuredOutputs, StructuredOutputs

VOCAB = 49152
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
    "required": ["id", "tags"],
}
SO = StructuredOutputs(json=json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def cache(smollm2_tokenizer):
    return GrammarCache(smollm2_tokenizer, VOCAB, [EOS])


@pytest.fixture()
def state(cache):
    return GrammarState(lambda: cache, VOCAB, torch.device("cpu"))


def allowed(state: GrammarState, seq_ids: list[int], row: int) -> set[int]:
    rows = state.rows(seq_ids)
    assert rows is not None
    out = apply_token_bitmask(torch.zeros(len(seq_ids), VOCAB), rows)
    return set(torch.nonzero(out[row] == 0).flatten().tolist())


def test_cache_returns_the_same_compile(cache):
    assert cache.get(SO) is cache.get(StructuredOutputs(json=json.dumps(SCHEMA)))
    assert cache.get(StructuredOutputs(choice=["a", "b"])) is not cache.get(StructuredOutputs(choice=["a", "c"]))


def test_walk_a_valid_completion_then_only_eos(state, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode('{"id": 12, "tags": ["x", "y"]}', add_special_tokens=False)
    state.add(1, SO, [])
    for t in ids:
        assert t in allowed(state, [9, 1], 1)  # row 0 (seq 9) has no grammar
        assert state.record([9, 1], [0, t]) == {}
    assert allowed(state, [1], 0) == {EOS}  # complete: EOS is the only way on
    assert state.rows([9]) is None  # a step without a constrained row does no grammar work


def test_replay_after_reregistration_equals_the_live_matcher(state, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode('{"id": 3, "tags": ["', add_special_tokens=False)
    state.add(1, SO, [])
    for t in ids:
        state.rows([1])
        state.record([1], [t])
    live = allowed(state, [1], 0)
    state.remove(1)
    state.add(1, SO, ids)  # preempted and back: the output so far is replayed
    assert allowed(state, [1], 0) == live
    assert len(live) > 1000  # inside a string: most tokens


def test_rejected_token_and_replay_error(state):
    state.add(1, StructuredOutputs(choice=["yes", "no"]), [])
    state.rows([1])
    assert list(state.record([1], [EOS])) == [1]  # EOS before a choice is complete
    state.add(2, StructuredOutputs(choice=["yes", "no"]), [EOS])
    with pytest.raises(ValueError, match="replayed output token"):
        state.rows([2])


def test_a_constraint_that_does_not_compile_raises_at_the_step(state):
    state.add(1, StructuredOutputs(regex="(ab"), [])
    with pytest.raises(InvalidStructuredOutputs, match=r"structured_outputs.regex does not compile: .*parenthesis"):
        state.rows([1])
    state.remove(1)
    assert len(state) == 0 and state.rows([1]) is None


def test_a_constraint_that_allows_no_token_says_so(state):
    # "[^\s\S]" matches no string: every bit of its mask is 0, the row samples from all -inf, and the error must say
    # the constraint allows nothing (a client error, runtime.scheduler.finish), not that the grammar rejects token 0
    state.add(1, StructuredOutputs(regex=r"[^\s\S]"), [])
    assert allowed(state, [1], 0) == set()
    assert state.record([1], [0])[1].startswith(NO_TOKEN)
    state.add(2, StructuredOutputs(choice=["yes", "no"]), [])
    state.rows([2])
    assert state.record([2], [EOS])[2].startswith("GrammarError")  # a token outside a non-empty mask: as before
