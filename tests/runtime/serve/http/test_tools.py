"""The HTTP server's tool and chat-template fields without a server: tools / tool_choice / parallel_tool_calls mapped
onto ChatOptions and the answer's ToolSetup (the grammar of "required" and a named function), history with tool
calls and tool results, the template options, the 400s naming the field; answers with tool calls, non-streamed and
streamed (the streamed deltas fold into the non-streamed message)."""

from __future__ import annotations

import json

import orjson
import pytest

from runtime import protocol as p
from runtime.serve.http.errors import OpenAIError
from runtime.serve.http.openai_schema import ChatCompletionRequest, chat_messages, decode
from runtime.serve.http.request_map import chat_request
from runtime.serve.http.tool_answer import ToolCallStream, chat_message
from runtime.serve.http.tool_request import ToolSetup
from runtime.text.tool_parsers import HermesToolParser, Llama3JsonToolParser

MSG = [{"role": "user", "content": "hi"}]


def _tool(name: str, parameters: dict | None = None) -> dict:
    function: dict = {"name": name, "description": f"the {name} function"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = _tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
NOW = _tool("now")
TOOLS = [WEATHER, NOW]


def chat(**fields) -> ChatCompletionRequest:
    return decode(orjson.dumps({"messages": MSG, **fields}), ChatCompletionRequest)


def _error(req: ChatCompletionRequest) -> tuple[str | None, str | None]:
    with pytest.raises(OpenAIError) as info:
        chat_request(req, "r")
    assert info.value.status == 400
    return info.value.code, info.value.param


def test_auto_is_the_default_with_tools():
    out = chat_request(chat(tools=TOOLS), "r")
    assert out.request.chat_options == p.ChatOptions(tools=TOOLS)
    assert out.tools == ToolSetup(HermesToolParser, True, None)
    assert chat_request(chat(tools=TOOLS), "r", Llama3JsonToolParser).tools.parser is Llama3JsonToolParser


def test_none_renders_the_tools_and_parses_nothing():
    out = chat_request(chat(tools=TOOLS, tool_choice="none"), "r")
    assert out.request.chat_options == p.ChatOptions(tools=TOOLS)
    assert out.tools is None
    plain = chat_request(chat(), "r")
    assert plain.request.chat_options is None and plain.tools is None


def _tags(setup: ToolSetup) -> dict:
    assert setup.constraint is not None
    return json.loads(setup.constraint.structural_tag)["format"]


def test_required_and_named_build_their_grammar():
    required = chat_request(chat(tools=TOOLS, tool_choice="required"), "r").tools
    fmt = _tags(required)
    assert [t["begin"] for t in fmt["tags"]] == [
        '<tool_call>\n{"name": "get_weather", "arguments": ',
        '<tool_call>\n{"name": "now", "arguments": ',
    ]
    assert [t["content"]["json_schema"] for t in fmt["tags"]] == [WEATHER["function"]["parameters"], {"type": "object"}]
    empty = chat_request(chat(tools=[_tool("f", {})], tool_choice="required"), "r").tools
    assert [t["content"]["json_schema"] for t in _tags(empty)["tags"]] == [{"type": "object"}]  # {} allowed any JSON
    assert (fmt["at_least_one"], fmt["stop_after_first"], required.parallel) == (True, False, True)
    single = chat_request(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), "r").tools
    assert (_tags(single)["stop_after_first"], single.parallel) == (True, False)
    choice = {"type": "function", "function": {"name": "now"}}
    named = chat_request(chat(tools=TOOLS, tool_choice=choice), "r").tools
    assert [t["begin"] for t in _tags(named)["tags"]] == ['<tool_call>\n{"name": "now", "arguments": ']
    assert (_tags(named)["stop_after_first"], named.parallel) == (True, False)


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"tools": {"a": 1}}, "invalid_type", "tools"),
        ({"tools": [{"type": "code"}]}, "invalid_value", "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "invalid_type", "tools[0].function"),
        ({"tools": [_tool("bad name")]}, "invalid_value", "tools[0].function.name"),
        ({"tools": [NOW, NOW]}, "invalid_value", "tools[1].function.name"),
        ({"tools": [_tool("f", [1])]}, "invalid_value", "tools[0].function.parameters"),
        # arguments are an object (OpenAI refuses other types): "required" forced [1, 2, 3], which no parser reads
        ({"tools": [NOW, _tool("f", {"type": "array"})]}, "invalid_value", "tools[1].function.parameters"),
        ({"tools": [_tool("f")] * 129}, "invalid_value", "tools"),
        ({"tool_choice": "required"}, "invalid_value", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "invalid_value", "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "invalid_value",
            "tool_choice",
        ),
        ({"continue_final_message": True, "add_generation_prompt": True}, "invalid_value", "continue_final_message"),
        ({"chat_template_kwargs": {"tools": [], "x": 1}}, "invalid_value", "chat_template_kwargs"),
    ],
)
def test_bad_tool_and_template_fields_are_400_naming_the_field(fields, code, param):
    assert _error(chat(**fields)) == (code, param)


def test_template_options():
    kwargs = chat_request(chat(chat_template_kwargs={"enable_thinking": False}), "r").request.chat_options
    assert kwargs == p.ChatOptions(chat_template_kwargs={"enable_thinking": False})
    cont = chat_request(chat(continue_final_message=True), "r").request.chat_options
    assert cont == p.ChatOptions(add_generation_prompt=False, continue_final_message=True)
    closed = chat_request(chat(add_generation_prompt=False), "r").request.chat_options
    assert closed == p.ChatOptions(add_generation_prompt=False)
    assert chat_request(chat(add_generation_prompt=True, chat_template_kwargs={}), "r").request.chat_options is None


def test_history_with_tool_calls_and_results():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": [{"type": "text", "text": "-3 C"}], "tool_call_id": "call_1"},
    ]
    decoded = decode(orjson.dumps({"messages": msgs}), ChatCompletionRequest).messages
    assert chat_messages(decoded) == [
        p.ChatMessage("user", "Weather?"),
        p.ChatMessage("assistant", None, [p.ChatToolCall("call_1", "get_weather", '{"city": "Oslo"}')]),
        p.ChatMessage("tool", "-3 C", None, "call_1"),
    ]


HERMES = ToolSetup(HermesToolParser, True, None)
TWO_CALLS = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)


def _calls(message: dict) -> list[tuple[str, str]]:
    for call in message["tool_calls"]:
        assert call["id"].startswith("call_") and len(call["id"]) == 29 and call["type"] == "function"
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def test_non_streamed_message():
    message, finish = chat_message(TWO_CALLS, "stop", HERMES)
    assert (message["content"], finish) == ("Checking.", "tool_calls")
    assert _calls(message) == [("get_weather", '{"city": "Oslo"}'), ("now", "{}")]
    single, _ = chat_message(TWO_CALLS, "stop", ToolSetup(HermesToolParser, False, None))
    assert _calls(single) == [("get_weather", '{"city": "Oslo"}')]
    only, _ = chat_message('<tool_call>{"name": "now"}</tool_call>', "stop", HERMES)
    assert only["content"] is None
    text = "<tool_call>{broken</tool_call>"
    assert chat_message(text, "stop", HERMES) == ({"role": "assistant", "content": text}, "stop")
    assert chat_message(TWO_CALLS, "length", None) == ({"role": "assistant", "content": TWO_CALLS}, "length")
    # cut by max_tokens after a whole call and inside the next: the calls are returned, but the answer is cut
    # ("length", as OpenAI ends any answer max_tokens cut), not "tool_calls" with the half call as content
    cut, finish = chat_message(TWO_CALLS[:-25], "length", HERMES)
    assert (_calls(cut), finish) == ([("get_weather", '{"city": "Oslo"}')], "length")
    assert chat_message(TWO_CALLS, "abort", HERMES)[1] == "abort"


def test_streamed_deltas_fold_into_the_non_streamed_message():
    for size in (1, 3, 10, len(TWO_CALLS)):
        stream = ToolCallStream(HERMES)
        pieces = [TWO_CALLS[i : i + size] for i in range(0, len(TWO_CALLS), size)]
        deltas = []
        for i, piece in enumerate(pieces):
            deltas += stream.deltas(piece, i == len(pieces) - 1)
        content = "".join(d.get("content", "") for d in deltas)
        heads = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
        args = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" not in d["tool_calls"][0]]
        assert content == "Checking."
        assert [(h["index"], h["type"], h["function"]) for h in heads] == [
            (0, "function", {"name": "get_weather", "arguments": ""}),
            (1, "function", {"name": "now", "arguments": ""}),
        ]
        assert args == [
            {"index": 0, "function": {"arguments": '{"city": "Oslo"}'}},
            {"index": 1, "function": {"arguments": "{}"}},
        ]
        assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason(None) is None
        assert stream.finish_reason("length") == "length"
