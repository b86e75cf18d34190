"""CompletionStream and min_tokens (stop strings looked for only after the first min_tokens tokens' text, vLLM's
rule: tests/detokenizer/test_min_tokens.py there uses the same sentence), and prompt logprobs on the text path
(accumulated from position 0, each token named)."""

from __future__ import annotations

import pytest

from runtime.protocol import PromptLogprobs, TokenLogprobs, TokenOutput
from runtime.sampling_params import SamplingParams
from runtime.text.completion_stream import CompletionStream

TEXT = " is Lee, and I'm a student in the college of engineering"


@pytest.mark.parametrize("min_tokens", [0, 1, 5])
@pytest.mark.parametrize("one_by_one", [True, False])
def test_stop_strings_wait_for_min_tokens(smollm2_tokenizer, min_tokens, one_by_one):
    ids = smollm2_tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(stop=["e"], min_tokens=min_tokens, max_tokens=len(ids))
    s = CompletionStream(smollm2_tokenizer, params)
    feeds = [[t] for t in ids] if one_by_one else [ids]
    streamed = ""
    for i, part in enumerate(feeds):
        finish = "length" if i == len(feeds) - 1 else None
        streamed += s.feed(TokenOutput("r", 0, part, finish)).text
    before = len(smollm2_tokenizer.decode(ids[:min_tokens]))
    expected = TEXT[: TEXT.index("e", before)]
    assert (s.text, streamed, s.finish_reason) == (expected, expected, "stop")
    kept = smollm2_tokenizer.decode(s.token_ids)
    assert kept.startswith(expected) and not smollm2_tokenizer.decode(s.token_ids[:-1]).startswith(expected)
    if min_tokens == 5:
        assert "e" in TEXT[:before]  # the rule mattered: the first "e" lies in the first 5 tokens' text


def test_prompt_logprobs_accumulate_with_their_texts(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("Hello there world", add_special_tokens=False)
    s = CompletionStream(smollm2_tokenizer, SamplingParams(max_tokens=0, prompt_logprobs=1))
    first = PromptLogprobs(0, ids[:2], [None, TokenLogprobs(-1.5, [ids[0]], [-0.25])], [0, 4])
    rest = PromptLogprobs(2, ids[2:], [TokenLogprobs(-0.5, [ids[2]], [-0.5])], [1])
    d1 = s.feed(TokenOutput("r", 0, [], prompt_logprobs=first))
    d2 = s.feed(TokenOutput("r", 0, [], "length", prompt_logprobs=rest))
    assert not d1.empty and d1.prompt_logprobs == first
    names = [smollm2_tokenizer.decode([t]) for t in ids]
    assert [t.text for t in d1.prompt_token_texts] == names[:2]
    assert d1.prompt_token_texts[1].top_texts == [names[0]]
    assert [t.text for t in d2.prompt_token_texts] == names[2:]
    assert s.prompt_logprobs == PromptLogprobs(0, ids, first.logprobs + rest.logprobs, [0, 4, 1])
    assert (d2.finish_reason, d2.token_ids, s.text) == ("length", [], "")
