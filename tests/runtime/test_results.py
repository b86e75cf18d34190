"""CompletionFold, the one fold of a request's StreamChunks into its Choices, Usage and time to first token, that the
client, the Engine and the HTTP server share: exact values for text, token_ids, logprobs alignment, finish_reason,
score, usage summed over n completions with every field, and ttft."""

from __future__ import annotations

import pytest

from runtime import protocol as p
from runtime.results import Choice, Completion, CompletionFold


def lp(x: float) -> p.TokenLogprobs:
    return p.TokenLogprobs(x, [1], [x])


def test_two_interleaved_completions_fold_into_their_choices_and_the_summed_usage():
    fold = CompletionFold(n=2, start=10.0)
    chunks = [
        (p.StreamChunk(rid="r", index=1, text="", token_ids=[], finish_reason=None), 10.5),  # nothing yet
        (p.StreamChunk(rid="r", index=1, text="Hel", token_ids=[7, 8], logprobs=[lp(-0.1), lp(-0.2)]), 10.75),
        (p.StreamChunk(rid="r", index=0, text="A", token_ids=[3], logprobs=[lp(-1.0)]), 11.0),
        (
            p.StreamChunk(
                rid="r",
                index=0,
                text="B",
                token_ids=[4],
                logprobs=[lp(-2.0)],
                finish_reason="length",
                usage=p.Usage(5, 4, 2, 0.25, 4),
            ),
            11.5,
        ),
    ]
    assert [fold.add(c, t) for c, t in chunks] == [False, False, False, False]
    assert (fold.num_chars(0), fold.num_chars(1), fold.ttft_s) == (2, 3, 0.75)
    assert fold.usage() == p.Usage(5, 4, 2, 0.25, 4)  # only completion 0 finished so far
    last = p.StreamChunk(
        rid="r",
        index=1,
        text="lo",
        token_ids=[9, 2],
        logprobs=[lp(-0.3), lp(-0.4)],
        finish_reason="stop",
        usage=p.Usage(5, 4, 4, 0.25, 4),
    )
    assert fold.add(last, 12.0) is True and fold.done
    assert fold.choices() == [
        Choice(
            index=0,
            text="AB",
            token_ids=[3, 4],
            finish_reason="length",
            logprobs=[lp(-1.0), lp(-2.0)],
            usage=p.Usage(5, 4, 2, 0.25, 4),
        ),
        Choice(
            index=1,
            text="Hello",
            token_ids=[7, 8, 9, 2],
            finish_reason="stop",
            logprobs=[lp(-0.1), lp(-0.2), lp(-0.3), lp(-0.4)],
            usage=p.Usage(5, 4, 4, 0.25, 4),
        ),
    ]
    # every field of the prompt's usage (queue_time_s and host_cached_tokens too), completion_tokens summed
    assert fold.usage() == p.Usage(5, 4, 6, 0.25, 4)
    assert fold.completion("r") == Completion(rid="r", choices=fold.choices(), usage=fold.usage(), ttft_s=0.75)


def test_logprobs_stay_aligned_with_token_ids():
    fold = CompletionFold(n=1, start=0.0)
    fold.add(p.StreamChunk(rid="r", text="a", token_ids=[1, 2]), 1.0)  # no logprobs: none yet
    assert fold.choices()[0].logprobs is None
    fold.add(p.StreamChunk(rid="r", text="b", token_ids=[3], logprobs=[lp(-0.5)]), 2.0)
    fold.add(p.StreamChunk(rid="r", text="c", token_ids=[4, 5]), 3.0)  # a chunk without them: one None per token
    fold.add(p.StreamChunk(rid="r", token_ids=[], logprobs=[], finish_reason="stop", usage=p.Usage(3, 0, 5)), 4.0)
    [choice] = fold.choices()
    assert choice.token_ids == [1, 2, 3, 4, 5]
    assert choice.logprobs == [None, None, lp(-0.5), None, None]
    never = CompletionFold(n=1, start=0.0)
    never.add(p.StreamChunk(rid="r", text="x", token_ids=[1], finish_reason="stop", usage=p.Usage(1, 0, 1)), 1.0)
    assert never.choices()[0].logprobs is None  # not asked for: None, not a list of Nones
    asked_empty = CompletionFold(n=1, start=0.0)
    asked_empty.add(p.StreamChunk(rid="r", logprobs=[], finish_reason="abort", usage=p.Usage(1, 0, 0)), 1.0)
    assert asked_empty.choices()[0].logprobs == []


def test_token_texts_stay_aligned_with_token_ids_as_logprobs_do():
    fold = CompletionFold(n=1, start=0.0)
    fold.add(p.StreamChunk(rid="r", text="a", token_ids=[1, 2]), 1.0)  # no texts: none yet
    assert fold.choices()[0].token_texts is None
    texts = [p.TokenText("b", ["b", "c"])]
    fold.add(p.StreamChunk(rid="r", text="b", token_ids=[3], logprobs=[lp(-0.5)], token_texts=texts), 2.0)
    fold.add(p.StreamChunk(rid="r", text="c", token_ids=[4]), 3.0)  # a chunk without them: one None per token
    fold.add(p.StreamChunk(rid="r", token_ids=[], token_texts=[], finish_reason="stop", usage=p.Usage(3, 0, 4)), 4.0)
    [choice] = fold.choices()
    assert choice.token_ids == [1, 2, 3, 4]
    assert choice.token_texts == [None, None, p.TokenText("b", ["b", "c"]), None]
    assert choice.logprobs == [None, None, lp(-0.5), None]


def test_beam_search_completions_keep_their_scores_best_first():
    fold = CompletionFold(n=2, start=0.0)
    for i, (ids, score) in enumerate([([5, 6, 7], -0.5), ([5, 8], -0.75)]):
        chunk = p.StreamChunk(
            rid="b",
            index=i,
            text="",
            token_ids=ids,
            finish_reason="length",
            usage=p.Usage(4, 0, len(ids), 0.0, 0),
            score=score,
        )
        fold.add(chunk, 1.0 + i)
    assert [(c.token_ids, c.score, c.finish_reason) for c in fold.choices()] == [
        ([5, 6, 7], -0.5, "length"),
        ([5, 8], -0.75, "length"),
    ]
    assert fold.usage() == p.Usage(4, 0, 5, 0.0, 0)


def test_before_anything_finished_and_without_tokens():
    fold = CompletionFold(n=2, start=3.0)
    assert (fold.done, fold.ttft_s, fold.usage()) == (False, None, p.Usage(0, 0, 0))
    fold.add(p.StreamChunk(rid="r", index=0, finish_reason="abort", usage=p.Usage(6, 0, 0, None, 0)), 4.0)
    fold.add(p.StreamChunk(rid="r", index=0, finish_reason="abort", usage=p.Usage(6, 0, 0, None, 0)), 4.5)
    assert fold.done is False  # a repeated last chunk finishes its completion once
    fold.add(p.StreamChunk(rid="r", index=1, finish_reason="abort", usage=p.Usage(6, 0, 0, None, 0)), 5.0)
    assert (fold.done, fold.ttft_s, fold.usage()) == (True, None, p.Usage(6, 0, 0, None, 0))
    assert fold.completion("r").ttft_s == 0.0  # the client's Completion: 0.0 when no chunk had tokens
    with pytest.raises(IndexError):
        fold.add(p.StreamChunk(rid="r", index=2), 6.0)
