"""What a prompt may cost before it is rejected (issue 12, class 3): the number of chat messages is bounded, each
message counts its template overhead toward the character limit and the inline (cheap) test, and input_ids that can
never fit the context are refused before any O(len) work. Engine path (encode_prompt) and server path (PromptPrep)."""

from __future__ import annotations

import pytest

from runtime import protocol as p
from runtime.prompt_check import (
    CHAT_MESSAGE_CHARS,
    MAX_CHAT_MESSAGES,
    PromptProblem,
    check_prompt,
    check_prompt_chars,
    prompt_chars,
)
from runtime.sampling_params import SamplingParams
from runtime.scheduler.request import RequestRejected
from runtime.serve.tokenizer.prompt_prep import INLINE_CHARS, PromptPrep
from runtime.text.prompt import PromptError, encode_prompt

EMPTY = {"role": "", "content": ""}
READY = p.Ready(num_blocks=32, block_size=4, max_model_len=64, num_host_blocks=0, vocab_size=49152, eos_token_ids=[2])


def _req(**inputs) -> p.GenerateRequest:
    if "messages" in inputs:
        inputs["messages"] = [p.ChatMessage(**m) for m in inputs["messages"]]
    return p.GenerateRequest(rid="r", sampling_params=SamplingParams(max_tokens=2), **inputs)


def test_the_number_of_messages_is_bounded_whatever_the_character_limit():
    assert (MAX_CHAT_MESSAGES, CHAT_MESSAGE_CHARS) == (4096, 32)
    too_many = PromptProblem(p.ERR_INVALID, "too many messages: 4097, the limit is 4096 (MAX_CHAT_MESSAGES)")
    for limit in (None, 10**9):
        assert check_prompt_chars(None, [EMPTY] * 4097, limit) == too_many
        assert check_prompt_chars(None, [EMPTY] * 4096, limit) is None
    with pytest.raises(PromptError) as info:  # the Engine's path: rejected before the (absent) tokenizer is touched
        encode_prompt(None, messages=[EMPTY] * 200_000)
    assert str(info.value) == "too many messages: 200000, the limit is 4096 (MAX_CHAT_MESSAGES)"


def test_each_message_counts_its_template_overhead():
    chat = [{"role": "user", "content": "hello"}, EMPTY]
    assert prompt_chars(None, chat) == 9 + 2 * 32 and prompt_chars(None, [EMPTY] * 4096) == 131072
    assert check_prompt_chars(None, [EMPTY] * 4096, 131072) is None
    assert check_prompt_chars(None, [EMPTY] * 4096, 131071) == PromptProblem(
        p.ERR_INVALID,
        "messages too long: 131072 characters (32 per message for the chat template included), the "
        "limit is 131071 (max_prompt_chars)",
    )
    assert check_prompt_chars("x" * 73, None, 72).message == (
        "prompt too long: 73 characters, the limit is 72 (max_prompt_chars)"
    )  # prompts: unchanged


def test_many_empty_messages_are_not_prepared_on_the_loop_thread():
    prep = PromptPrep(None, READY)
    assert INLINE_CHARS == 2048
    assert prep.cheap(_req(messages=[EMPTY] * 64))  # 64 x 32 = 2048 counted characters: ~0.6 ms to render
    assert not prep.cheap(_req(messages=[EMPTY] * 65))
    assert not prep.cheap(_req(messages=[EMPTY] * 4096))
    assert prep.cheap(_req(prompt="a" * 2048)) and not prep.cheap(_req(prompt="a" * 2049))


def test_precheck_rejects_floods_and_impossible_input_ids_before_any_per_item_work():
    prep = PromptPrep(None, READY)  # 64 tokens of context, 31 usable blocks of 4
    with pytest.raises(RequestRejected) as info:
        prep.precheck(_req(messages=[EMPTY] * 200_000))
    assert (info.value.code, str(info.value)) == (
        p.ERR_INVALID,
        "too many messages: 200000, the limit is 4096 (MAX_CHAT_MESSAGES)",
    )
    ids = [10**9] * 2_000_000  # outside the vocabulary too: the O(1) length check answers first, as check_prompt does
    with pytest.raises(RequestRejected) as info:
        prep.precheck(_req(input_ids=ids))
    assert (info.value.code, str(info.value)) == (
        p.ERR_CONTEXT,
        "prompt of 2000000 tokens leaves no room to generate under max_model_len 64",
    )
    assert check_prompt(ids, 64, 49152, 4, 32) == (info.value.code, str(info.value))
    prep.precheck(_req(input_ids=[10**9] * 63))  # fits the context: the vocabulary is checked in prepare
    with pytest.raises(RequestRejected) as info:
        prep.prepare("1", _req(input_ids=[10**9] * 63))
    assert (info.value.code, str(info.value)) == (
        p.ERR_INVALID,
        f"token ids outside the vocabulary [0, 49152): {[10**9] * 8}",
    )
