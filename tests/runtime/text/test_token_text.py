"""Token ids as text for answers that name tokens (runtime/text/token_text.py): TokenTextCache names a token as
decode([id]) does, once per id; a CompletionStream asked for logprobs sends each token's TokenText aligned with its
token_ids, a stop string dropping both."""

from __future__ import annotations

from runtime.protocol import TokenLogprobs, TokenOutput, TokenText
from runtime.sampling_params import SamplingParams
from runtime.text.completion_stream import CompletionStream
from runtime.text.token_text import TokenTextCache

HI, THERE = 26843, 665  # "Hi", " there" in the SmolLM2 tokenizer
IM_END = 2  # "<|im_end|>", a special token


class _NoBackend:
    """The SmolLM2 tokenizer behind its decode, counting decodes."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.decodes = 0

    def decode(self, ids, skip_special_tokens=False):
        self.decodes += 1
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_token_text_cache_names_each_token_as_decode_does_once_per_id(smollm2_tokenizer):
    tok = _NoBackend(smollm2_tokenizer)
    cache = TokenTextCache(tok)
    byte = smollm2_tokenizer.encode("🎉")[0]  # part of a 4-byte character: U+FFFD alone
    assert cache.text(byte) == smollm2_tokenizer.decode([byte]) == "\ufffd"
    assert cache.token_text(HI, TokenLogprobs(-0.1, [HI, IM_END], [-0.1, -3.0])) == TokenText(
        "Hi", ["Hi", "<|im_end|>"]
    )
    assert cache.token_text(THERE, None) == TokenText(" there", [])
    assert cache.token_text(HI, TokenLogprobs(-0.1, [THERE], [-0.1])) == TokenText("Hi", [" there"])
    assert tok.decodes == 4  # byte, HI, IM_END, THERE: each decoded once


def _out(ids, finish=None, logprobs=None) -> TokenOutput:
    return TokenOutput("r", 0, list(ids), finish, None, logprobs)


def test_a_stream_sends_token_texts_aligned_and_a_stop_string_drops_them(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(" big world! more", add_special_tokens=False)
    texts = [smollm2_tokenizer.decode([t]) for t in ids]
    s = CompletionStream(smollm2_tokenizer, SamplingParams(stop=["orld"], logprobs=1))
    lps = [TokenLogprobs(-0.5, [t, HI], [-0.5, -2.0]) for t in ids]
    deltas = [s.feed(_out([t], logprobs=[lp])) for t, lp in zip(ids, lps, strict=True)]
    assert [d.token_texts for d in deltas] == [
        [TokenText(texts[0], [texts[0], "Hi"])],
        [TokenText(texts[1], [texts[1], "Hi"])],  # " w" + "orld...": the stop string begins in it, it is kept
        None,  # the completion ended: nothing more
        None,
    ]
    assert s.token_texts == [TokenText(texts[0], [texts[0], "Hi"]), TokenText(texts[1], [texts[1], "Hi"])]
    assert s.token_ids == ids[:2]
    # a token without logprobs is still named; no logprobs asked, or no tokenizer: no texts
    s = CompletionStream(smollm2_tokenizer, SamplingParams(logprobs=0))
    d = s.feed(_out([HI, THERE], "length", logprobs=[TokenLogprobs(-0.1, [], []), None]))
    assert d.token_texts == [TokenText("Hi", []), TokenText(" there", [])] == s.token_texts
    assert CompletionStream(smollm2_tokenizer, SamplingParams()).feed(_out([HI], "length")).token_texts is None
    assert CompletionStream(None, SamplingParams(logprobs=1)).feed(_out([HI], "length")).token_texts is None


def test_streamed_token_texts_concatenate_to_the_final_ones(smollm2_tokenizer):
    ids = [HI, 0] + smollm2_tokenizer.encode(" there STOP now", add_special_tokens=False)
    shared = TokenTextCache(smollm2_tokenizer)
    s = CompletionStream(smollm2_tokenizer, SamplingParams(stop=[" STOP"], logprobs=0), texts=shared)
    deltas = [s.feed(_out([t], logprobs=[TokenLogprobs(-1.0, [], [])])) for t in ids]
    streamed = [t for d in deltas for t in (d.token_texts or [])]
    assert streamed == s.token_texts == [TokenText("Hi", []), TokenText("<|endoftext|>", []), TokenText(" there", [])]
    assert [t for d in deltas for t in d.token_ids] == s.token_ids == ids[:3]
    assert shared.text(0) == "<|endoftext|>"  # the stream filled the shared cache
