"""Detokenizer (multi-byte safe), StopChecker (hold-back, keep count) and chat-template application."""

from __future__ import annotations

import pytest

from runtime.tokenizer import REPLACEMENT_CHAR, ChatTemplateError, Detokenizer, StopChecker, apply_chat_template

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
