"""A GenerateRequest's chat_options and tool turns across the public socket: the strict frame reader keeps them, the
tokenizer process renders the prompt with them (the ids encode_prompt gives), and a bad option is ERR_INVALID."""

from __future__ import annotations

import msgspec
import pytest

from runtime import protocol as p
from runtime.protocol.client_frame import decode_client_frame
from runtime.scheduler.request import RequestRejected
from runtime.serve.tokenizer.prompt_prep import PromptPrep
from runtime.text.prompt import encode_prompt
from tests.runtime.serve.tokenizer.rig import READY

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
MESSAGES = [
    p.ChatMessage("user", "Weather in Oslo?"),
    p.ChatMessage("assistant", None, [p.ChatToolCall("call_1", "get_weather", '{"city": "Oslo"}')]),
    p.ChatMessage("tool", "-3 C", tool_call_id="call_1"),
]


def _request(options: p.ChatOptions) -> p.GenerateRequest:
    return p.GenerateRequest(rid="r1", messages=MESSAGES, chat_options=options)


def test_the_frame_reader_keeps_chat_options_and_tool_turns():
    req = _request(p.ChatOptions(tools=[WEATHER], chat_template_kwargs={"x": [1, {"y": None}]}))
    assert decode_client_frame(msgspec.msgpack.encode(req), 1 << 20) == req


def test_the_tokenizer_process_renders_with_the_options(smollm2_tokenizer):
    prep = PromptPrep(smollm2_tokenizer, READY)
    for options in (p.ChatOptions(tools=[WEATHER]), p.ChatOptions(add_generation_prompt=False)):
        req = _request(options)
        prep.precheck(req)
        ids = prep.prepare("i1", req).message.input_ids
        assert ids == encode_prompt(smollm2_tokenizer, messages=MESSAGES, chat_options=options)
    with_tools = encode_prompt(smollm2_tokenizer, messages=MESSAGES, chat_options=p.ChatOptions(tools=[WEATHER]))
    without = encode_prompt(smollm2_tokenizer, messages=MESSAGES)
    assert len(with_tools) > len(without)  # the tools' signatures are in the system turn


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (p.ChatOptions(continue_final_message=True), "cannot both be true"),
        (p.ChatOptions(chat_template_kwargs={"tokenize": True}), r"may not set \['tokenize'\]"),
    ],
)
def test_bad_options_are_err_invalid(smollm2_tokenizer, options, message):
    prep = PromptPrep(smollm2_tokenizer, READY)
    with pytest.raises(RequestRejected, match=message) as info:
        req = _request(options)
        prep.precheck(req)
        prep.prepare("i1", req)
    assert info.value.code == p.ERR_INVALID


def test_the_router_routes_on_the_same_ids(smollm2_tokenizer):
    from router.text import RouterTokenizer

    req = _request(p.ChatOptions(tools=[WEATHER]))
    expected = encode_prompt(smollm2_tokenizer, messages=MESSAGES, chat_options=req.chat_options)
    assert RouterTokenizer(smollm2_tokenizer).prompt_ids(req) == expected


def test_tools_and_tool_calls_count_against_the_character_limit(smollm2_tokenizer):
    plain = PromptPrep(smollm2_tokenizer, READY).prompt_chars
    base = 3 * 32 + len("user") + len("Weather in Oslo?") + len("assistant") + len("tool") + len("-3 C")
    calls = len("call_1") + len("get_weather") + len('{"city": "Oslo"}') + len("call_1")
    tools = len('[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]')
    req = _request(p.ChatOptions(tools=[WEATHER]))
    PromptPrep(smollm2_tokenizer, READY, max_prompt_chars=base + calls + tools).precheck(req)
    with pytest.raises(
        RequestRejected, match=f"messages and tools too long: {base + calls + tools} characters"
    ) as info:
        PromptPrep(smollm2_tokenizer, READY, max_prompt_chars=base + calls + tools - 1).precheck(req)
    assert info.value.code == p.ERR_INVALID
    assert plain > base + calls + tools
    big = _request(p.ChatOptions(tools=[WEATHER] * 40))
    assert not PromptPrep(smollm2_tokenizer, READY).cheap(big)  # rendered on the worker thread, not the loop's
