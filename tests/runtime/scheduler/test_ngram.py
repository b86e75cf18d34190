"""The n-gram proposer (runtime/scheduler/ngram.py): hand-checked drafts, and, on random token sequences fed step by
step as decoding feeds them, the incremental index's drafts equal those of a direct search of the whole context
(the definition, written as plainly as possible); an index is rebuilt when its sequence changes and released with
its sequence."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.sampling_params import SamplingParams
from runtime.scheduler.ngram import NgramIndex, NgramProposer, NoProposer
from tests.runtime.scheduler.test_speculation import PROMPT, _answer, _scheduler


def reference(tokens: list[int], min_n: int, max_n: int, max_tokens: int) -> list[int]:
    """Prompt lookup by its definition: for the longest n whose last-n-token suffix occurs earlier with max_tokens
    tokens after it (else with any token after it), what followed the most recent such occurrence."""
    total = len(tokens)
    if max_tokens < 1 or total < min_n + 1:
        return []
    for last in (total - max_tokens, total - 1):
        for n in range(min(max_n, last), min_n - 1, -1):
            for end in range(last, n - 1, -1):
                if tokens[end - n : end] == tokens[total - n :]:
                    return tokens[end : end + max_tokens]
    return []


def test_ngram_proposes_what_followed_the_longest_recurring_suffix():
    def propose(tokens: list[int], max_tokens: int, min_n: int = 1, max_n: int = 3) -> list[int]:
        return NgramIndex(min_n, max_n).propose(tokens, max_tokens)

    assert propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]  # n = 3 matches at 0
    assert propose([7, 1, 2, 8, 5, 2, 6, 1, 2], 3) == [8, 5, 2]  # n = 2 ([1, 2]) beats n = 1 ([2] at 5)
    assert propose([4, 2, 5, 2, 6, 2], 1) == [6]  # n = 1: the most recent earlier occurrence
    assert propose([4, 2, 5, 2, 6, 2], 3) == [5, 2, 6]  # ... that three tokens follow
    assert propose([3, 3, 3, 3], 3) == [3, 3, 3]  # inside a run: an occurrence with a whole draft after it
    assert propose([1, 2, 3, 4], 3) == []  # nothing recurs
    assert propose([1, 2, 1], 0) == []
    assert propose([256, 1, 0, 0, 0, 1], 2) == [0, 0]
    assert propose([5, 1, 5], 2, 2, 2) == []  # [1, 5] does not recur
    assert NoProposer().propose(0, [1, 1, 1], 4) == []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.sampled_from([0, 1, 2, 3, 262143, 2**31 - 1]), min_size=1, max_size=80),
    steps=st.lists(st.integers(1, 6), min_size=1, max_size=40),
    min_n=st.integers(1, 3),
    extra_n=st.integers(0, 3),
    max_tokens=st.integers(0, 6),
)
def test_incremental_index_equals_the_definition(tokens, steps, min_n, extra_n, max_tokens):
    index = NgramIndex(min_n, min_n + extra_n)
    known = 1
    for step in steps:  # a decode step appends 1 token, or an accepted run of several
        got = index.propose(tokens[:known], max_tokens)
        assert got == reference(tokens[:known], min_n, min_n + extra_n, max_tokens)
        if known == len(tokens):
            break
        known = min(len(tokens), known + step)


def test_a_changed_sequence_is_reindexed():
    index = NgramIndex(1, 2)
    assert index.propose([1, 2, 3, 1, 2], 2) == [3, 1]
    assert index.propose([1, 2, 3, 1], 2) == [2, 3]  # shorter: rebuilt
    assert index.propose([4, 2, 3, 7, 2], 1) == [3]  # the last indexed token (index 3) changed: rebuilt
    assert index.propose([4, 2, 3, 7, 2, 9, 4, 2], 2) == [3, 7]


def test_proposer_keeps_an_index_per_sequence():
    p = NgramProposer(1, 2)
    assert p.propose(1, [1, 2, 3, 1, 2], 2) == [3, 1]
    assert p.propose(2, [7, 8, 7], 1) == [8]
    assert p.propose(1, [1, 2, 3, 1, 2, 3], 2) == [1, 2]
    assert p.num_indexed() == 2
    p.release(1)
    p.release(5)
    assert p.num_indexed() == 1


def test_scheduler_releases_the_index_of_a_finished_sequence():
    config = json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    )
    sched, manager = _scheduler(config=config)
    proposer = sched.speculation._proposer
    sched.add_request("a", PROMPT, SamplingParams(max_tokens=10, temperature=0.0))
    sched.process_result(_answer(sched.schedule(), {1: [5]}))
    batch = sched.schedule()  # a decode: its draft made the index
    assert proposer.num_indexed() == 1
    sched.abort("a")
    sched.process_result(_answer(batch, {1: [1]}))
    assert sched.schedule() is not None  # the drop goes out
    assert proposer.num_indexed() == 0
