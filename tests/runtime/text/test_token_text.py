"""Token ids as text for answers that name tokens (runtime/text/token_text.py): decode_text is the tokenizer's
decode with special tokens kept, on either path; TokenTextCache names a token as decode([id]) does, once per id; a
CompletionStream asked for logprobs sends each token's TokenText aligned with its token_ids, a stop string dropping
both; encode_prompt's add_special_tokens (a TokenizeRequest's) reaches the tokenizer."""

from __future__ import annotations

import random

from runtime.protocol import TokenLogprobs, TokenOutput, TokenText
from runtime.sampling_params import SamplingParams
from runtime.text.completion_stream import CompletionStream
from runtime.text.prompt import encode_prompt
from runtime.text.token_text import TokenTextCache, decode_text

HI, THERE = 26843, 665  # "Hi", " there" in the SmolLM2 tokenizer
IM_END = 2  # "<|im_end|>", a special token


class _NoBackend:
    """The SmolLM2 tokenizer without backend_tokenizer (decode_text's fallback: tokenizer.decode), counting decodes;
    encode adds a BOS id 1 in front when add_special_tokens (SmolLM2 itself adds none)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.decodes = 0
        self.chat_template = tokenizer.chat_template

    def decode(self, ids, skip_special_tokens=False):
        self.decodes += 1
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + self._tokenizer.encode(text, add_special_tokens=False)

    def apply_chat_template(self, *args, **kwargs):
        return self._tokenizer.apply_chat_template(*args, **kwargs)


def test_decode_text_is_the_tokenizers_decode_with_special_tokens(smollm2_tokenizer):
    rng = random.Random(7)
    ids = [rng.randrange(49152) for _ in range(5000)] + [0, 1, 2, IM_END]
    want = smollm2_tokenizer.decode(ids, skip_special_tokens=False)
    assert decode_text(smollm2_tokenizer, ids) == want  # the Rust decode_batch path
    assert decode_text(_NoBackend(smollm2_tokenizer), ids) == want  # the fallback
    emoji = smollm2_tokenizer.encode("🎉 héllo")
    assert decode_text(smollm2_tokenizer, emoji) == "🎉 héllo"
    assert decode_text(smollm2_tokenizer, emoji[:1]) == smollm2_tokenizer.decode(emoji[:1])  # a partial character
    assert decode_text(smollm2_tokenizer, [1, IM_END]) == "<|im_start|><|im_end|>"
    assert decode_text(smollm2_tokenizer, []) == ""


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


def test_encode_prompt_add_special_tokens_reaches_the_tokenizer(smollm2_tokenizer):
    tok = _NoBackend(smollm2_tokenizer)
    ids = smollm2_tokenizer.encode("Hi there")
    assert encode_prompt(tok, "Hi there") == [1, *ids]  # as a GenerateRequest's prompt
    assert encode_prompt(tok, "Hi there", add_special_tokens=False) == ids
    chat = [{"role": "user", "content": "Hi"}]
    assert encode_prompt(tok, messages=chat, add_special_tokens=True) == encode_prompt(smollm2_tokenizer, messages=chat)
