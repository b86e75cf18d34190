"""Detokenizer (multi-byte safe), StopChecker (hold-back, keep count), CompletionStream (the one text path) and
chat-template application."""

from __future__ import annotations

import pytest

from runtime.prompt_check import prompt_char_limit
from runtime.protocol import TokenLogprobs, TokenOutput, Usage
from runtime.sampling_params import SamplingParams
from runtime.text.completion_stream import CompletionStream
from runtime.text.detokenizer import REPLACEMENT_CHAR, Detokenizer
from runtime.text.prompt import ChatTemplateError, PromptError, apply_chat_template, encode_prompt, encode_text
from runtime.text.stop_strings import StopChecker

TEXT = "héllo 日本語 🎉 world\nUser: ok"


class _SlowTokenizer:
    """A tokenizer without backend_tokenizer, to exercise the windowed decoding path."""

    def __init__(self, fast) -> None:
        self._fast = fast

    def decode(self, ids, skip_special_tokens=True):
        return self._fast.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(params=["fast", "slow"])
def any_tokenizer(request, smollm2_tokenizer):
    return smollm2_tokenizer if request.param == "fast" else _SlowTokenizer(smollm2_tokenizer)


def test_detokenizer_multibyte_never_emits_replacement(any_tokenizer, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(TEXT, add_special_tokens=False)
    single = [smollm2_tokenizer.decode([i]) for i in ids]
    assert any(REPLACEMENT_CHAR in s for s in single)  # the text really splits characters across tokens
    detok = Detokenizer(any_tokenizer)
    chunks = [detok.step([i]) for i in ids]
    assert all(REPLACEMENT_CHAR not in c for c in chunks)
    assert "".join(chunks) == TEXT == detok.text
    assert len(detok.token_ends) == len(ids)
    assert detok.token_ends[-1] == len(TEXT)
    assert detok.token_ends == sorted(detok.token_ends)


def test_detokenizer_skips_special_tokens(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("Hi there", add_special_tokens=False) + [smollm2_tokenizer.eos_token_id]
    detok = Detokenizer(smollm2_tokenizer)
    assert detok.step(ids) == "Hi there"
    assert detok.token_ends[-1] == detok.token_ends[-2] == len("Hi there")


def _run(checker, detok, ids):
    emitted, result = [], None
    for i in ids:
        detok.step([i])
        result = checker.update(detok.text, detok.token_ends)
        emitted.append(result.new_text)
        if result.stopped:
            break
    return "".join(emitted), result


def test_stop_string_truncates_and_counts_kept_tokens(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(TEXT, add_special_tokens=False)
    detok, checker = Detokenizer(smollm2_tokenizer), StopChecker(["\nUser:"])
    text, result = _run(checker, detok, ids)
    assert result.stopped and result.stop_string == "\nUser:"
    assert text == "héllo 日本語 🎉 world"
    # keep = the fewest tokens whose text covers everything before the stop string
    assert smollm2_tokenizer.decode(ids[: result.keep_tokens]) == "héllo 日本語 🎉 world"
    assert smollm2_tokenizer.decode(ids[: result.keep_tokens - 1]) != "héllo 日本語 🎉 world"
    assert checker.update(detok.text, detok.token_ends) == ("", True, result.keep_tokens, "\nUser:")


def test_hold_back_never_leaks_a_stop_prefix():
    checker = StopChecker(["STOP"])
    ends: list[int] = []
    text = ""
    outs = []
    for piece in ["ab", "S", "T", "x", "ST", "OP", "zz"]:
        text += piece
        ends.append(len(text))
        r = checker.update(text, ends)
        outs.append(r.new_text)
        if r.stopped:
            break
    assert outs == ["ab", "", "", "STx", "", ""]
    assert r.stopped and r.keep_tokens == 4  # the stop string starts exactly where token 5 ("ST") starts
    assert "".join(outs) == "abSTx"


def test_stop_at_start_keeps_zero_and_flush_without_stop():
    checker = StopChecker(["<"])
    assert checker.update("<a", [1, 2]) == ("", True, 0, "<")
    other = StopChecker(["xyz"])
    r = other.update("abcx", [2, 4])
    assert r == ("abc", False, 2, None)
    assert other.flush("abcx") == "x"


def test_stop_inside_a_token_keeps_that_token():
    checker = StopChecker(["STOP"])
    assert checker.update("abcST", [2, 5]) == ("abc", False, 2, None)
    assert checker.update("abcSTOPx", [2, 5, 8]) == ("", True, 2, "STOP")


def test_earliest_of_several_stop_strings_wins():
    checker = StopChecker(["world", "lo"])
    r = checker.update("hello world", [5, 11])
    assert r == ("hel", True, 1, "lo")


def test_chat_template(smollm2_tokenizer):
    ids = apply_chat_template(smollm2_tokenizer, [{"role": "user", "content": "hi"}])
    text = smollm2_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids.count(smollm2_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    with pytest.raises(ChatTemplateError):
        apply_chat_template(smollm2_tokenizer, [{"content": "no role"}])


# ---- CompletionStream: the one text path (EOS, stop token ids, stop strings, streaming release, logprobs) --------


def _out(ids, finish=None, usage=None, logprobs=None) -> TokenOutput:
    return TokenOutput("r", 0, list(ids), finish, usage, logprobs)


def _lp(tid: int) -> TokenLogprobs:
    return TokenLogprobs(-0.5, [tid], [-0.5])


HI, THERE, WORLD = 26843, 665, 905  # "Hi", " there", " world" in the SmolLM2 tokenizer (none special)


def test_stream_keeps_eos_and_stop_ids_in_token_ids_but_not_in_text(smollm2_tokenizer):
    s = CompletionStream(smollm2_tokenizer, SamplingParams(), eos_token_ids=[WORLD])  # an EOS that is not special
    deltas = [s.feed(_out([HI], usage=Usage(3, 0, 1))), s.feed(_out([THERE])), s.feed(_out([WORLD], "stop"))]
    assert [(d.text, d.token_ids, d.finish_reason) for d in deltas] == [
        ("Hi", [HI], None),
        (" there", [THERE], None),
        ("", [WORLD], "stop"),
    ]
    assert (s.text, s.token_ids, s.finish_reason) == ("Hi there", [HI, THERE, WORLD], "stop")
    assert deltas[-1].usage == Usage(3, 0, 3) and deltas[-1].stop_keep_tokens is None
    assert s.feed(_out([THERE], "stop")).empty  # nothing after the end
    ignored = CompletionStream(smollm2_tokenizer, SamplingParams(ignore_eos=True), eos_token_ids=[WORLD])
    assert ignored.feed(_out([HI, WORLD], "length")).text == "Hi world"  # ignore_eos: an ordinary token
    stop_id = CompletionStream(smollm2_tokenizer, SamplingParams(stop_token_ids=[THERE]), eos_token_ids=[2])
    d = stop_id.feed(_out([HI, THERE], "stop"))
    assert (d.text, d.token_ids, d.finish_reason) == ("Hi", [HI, THERE], "stop")


def test_stream_stop_string_inside_a_token_tells_the_scheduler_what_to_keep(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(" big world! more", add_special_tokens=False)
    s = CompletionStream(smollm2_tokenizer, SamplingParams(stop=["orld"], logprobs=0))
    deltas = [s.feed(_out([t], logprobs=[_lp(t)])) for t in ids]
    assert [(d.text, d.token_ids, d.finish_reason, d.stop_keep_tokens) for d in deltas] == [
        (" big", ids[:1], None, None),
        (" w", ids[1:2], "stop", 2),
        ("", [], None, None),
        ("", [], None, None),
    ]
    assert (s.text, s.token_ids, s.logprobs) == (" big w", ids[:2], [_lp(t) for t in ids[:2]])
    # found in the step the scheduler ends it anyway: the stop string still wins, nothing to tell the scheduler
    late = CompletionStream(smollm2_tokenizer, SamplingParams(stop=["big"], logprobs=0))
    d = late.feed(_out(ids[:2], "length", logprobs=[_lp(t) for t in ids[:2]]))
    assert (d.text, d.token_ids, d.finish_reason, d.stop_keep_tokens) == (" ", ids[:1], "stop", None)
    assert d.logprobs == [_lp(ids[0])]


def test_stream_never_releases_a_token_a_later_stop_string_drops(smollm2_tokenizer):
    ids = [HI, 0] + smollm2_tokenizer.encode(" STOP", add_special_tokens=False)  # 0: a special token, no text
    s = CompletionStream(smollm2_tokenizer, SamplingParams(stop=[" STOP"]))
    deltas = [s.feed(_out([t])) for t in ids]
    assert "".join(d.text for d in deltas) == s.text == "Hi"
    assert [t for d in deltas for t in d.token_ids] == s.token_ids == [HI]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_keep_tokens == 1


def test_stream_releases_held_back_text_at_the_end_and_works_without_a_tokenizer(smollm2_tokenizer):
    s = CompletionStream(smollm2_tokenizer, SamplingParams(stop=[" thereafter"]))
    d = s.feed(_out([HI, THERE]))
    assert (d.text, d.token_ids) == ("Hi", [HI])  # " there" may begin the stop string: held back with its token
    d = s.feed(_out([], "abort"))
    assert (d.text, d.token_ids, d.finish_reason) == (" there", [THERE], "abort")
    assert (s.text, s.token_ids) == ("Hi there", [HI, THERE])
    bare = CompletionStream(None, SamplingParams(stop=["x"], logprobs=1))
    d = bare.feed(_out([5, 6], "length", Usage(2, 0, 2)))
    assert (d.text, d.token_ids, d.logprobs, d.usage) == ("", [5, 6], [None, None], Usage(2, 0, 2))


# ---- encode_prompt: the character limit, text the tokenizer cannot encode, the GIL-light encode ----------------------


def test_encode_prompt_bounds_the_text_before_tokenizing(smollm2_tokenizer):
    assert prompt_char_limit(None, 100) == 3200 and prompt_char_limit(50, 100) == 50
    assert encode_prompt(smollm2_tokenizer, "hello", max_chars=5) == smollm2_tokenizer.encode("hello")
    with pytest.raises(PromptError) as info:
        encode_prompt(smollm2_tokenizer, "hello!", max_chars=5)
    assert str(info.value) == "prompt too long: 6 characters, the limit is 5 (max_prompt_chars)"
    chat = [{"role": "user", "content": "hello"}]  # role + content: 9 characters, + 32 for the template
    with pytest.raises(PromptError) as info:
        encode_prompt(None, messages=chat, max_chars=40)  # rejected before the (absent) tokenizer is touched
    assert str(info.value) == (
        "messages too long: 41 characters (32 per message for the chat template included), the "
        "limit is 40 (max_prompt_chars)"
    )
    assert encode_prompt(smollm2_tokenizer, messages=chat, max_chars=41) == apply_chat_template(smollm2_tokenizer, chat)
    assert issubclass(ChatTemplateError, PromptError)


def test_text_the_tokenizer_cannot_encode_is_a_prompt_error(smollm2_tokenizer):
    cases = [
        ({"prompt": "a\ud800b"}, "prompt is not valid Unicode text: surrogates not allowed (character 1)"),
        (
            {"messages": [{"role": "user", "content": "\udfff"}]},
            "message 0 content is not valid Unicode text: surrogates not allowed (character 0)",
        ),
        ({"prompt": 12}, "the tokenizer cannot encode the prompt: "),
        ({"input_ids": [1, "x"]}, "input_ids must be integers: "),
    ]
    for inputs, message in cases:
        with pytest.raises(PromptError) as info:
            encode_prompt(smollm2_tokenizer, **inputs)
        assert type(info.value) is PromptError and str(info.value).startswith(message), inputs


def test_encode_text_gives_the_tokenizers_ids(smollm2_tokenizer):
    texts = ["", "Hello world", TEXT, "<|im_start|>user\nhi<|im_end|>", " 1, 2, 3\n\n\tx" * 50]
    for text in texts:
        for special in (True, False):
            assert encode_text(smollm2_tokenizer, text, special) == smollm2_tokenizer.encode(
                text, add_special_tokens=special
            )
    assert encode_text(_EncodeOnly(smollm2_tokenizer), "Hello world") == smollm2_tokenizer.encode("Hello world")


class _EncodeOnly:
    """A tokenizer without backend_tokenizer: encode_text falls back to its encode."""

    def __init__(self, fast) -> None:
        self.encode = fast.encode
