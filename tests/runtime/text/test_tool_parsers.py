"""Tool-call parsers on canned model outputs: hermes and llama3_json, one call, several, text around calls, malformed
and unterminated calls; every output parsed whole equals the same output fed in pieces (any cut)."""

from __future__ import annotations

import json
import random

import pytest

from runtime.text.tool_parsers import TOOL_PARSERS, Parsed, ToolCall, parse, tool_parser_class
from runtime.text.tool_parsers.hermes import HermesToolParser
from runtime.text.tool_parsers.llama3_json import Llama3JsonToolParser

WEATHER = ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ToolCall("get_time", '{"zone": "CET"}')


def _hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


HERMES_CASES = [
    (_hermes("get_weather", '{"city": "Paris", "unit": "celsius"}'), Parsed("", [WEATHER])),
    (
        "Let me look.\n" + _hermes("get_weather", '{"city":"Paris","unit":"celsius"}') + "\n",
        Parsed("Let me look.", [WEATHER]),
    ),
    (
        _hermes("get_weather", '{"city": "Paris", "unit": "celsius"}') + "\n" + _hermes("get_time", '{"zone": "CET"}'),
        Parsed("", [WEATHER, TIME]),
    ),
    # "parameters" instead of "arguments", arguments as JSON text, no arguments at all
    ('<tool_call>{"name": "get_time", "parameters": {"zone": "CET"}}</tool_call>', Parsed("", [TIME])),
    ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>', Parsed("", [TIME])),
    ('<tool_call>{"name": "now"}</tool_call>', Parsed("", [ToolCall("now", "{}")])),
    # unterminated at the end: still a call when it parses
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n', Parsed("", [TIME])),
    # malformed: content, tags and all; the valid call beside it stays a call
    ("<tool_call>\n{not json}\n</tool_call>", Parsed("<tool_call>\n{not json}\n</tool_call>", [])),
    (
        "<tool_call>{}</tool_call>\n" + _hermes("get_time", '{"zone": "CET"}') + " done",
        Parsed("<tool_call>{}</tool_call>done", [TIME]),
    ),
    ('<tool_call>{"name": "f", "arguments": {"a": ', Parsed('<tool_call>{"name": "f", "arguments": {"a": ', [])),
    (
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        Parsed('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ),
    # no call: the text unchanged, whitespace and a lone "<" included
    ("  Plain answer with a < sign.\n\n", Parsed("  Plain answer with a < sign.\n\n", [])),
    ("ends with <tool_", Parsed("ends with <tool_", [])),
    ("Unicode: é 北京 🙂", Parsed("Unicode: é 北京 🙂", [])),
]

LLAMA3_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', Parsed("", [WEATHER])),
    (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "arguments": {"zone": "CET"}}',
        Parsed("", [WEATHER, TIME]),
    ),
    ('  {"name": "get_time", "parameters": {"zone": "CET"}} ;\n', Parsed("", [TIME])),
    (
        '{"name": "get_time", "parameters": {"zone": "CET"}} and text',
        Parsed('{"name": "get_time", "parameters": {"zone": "CET"}} and text', []),
    ),
    ('{"name": "get_time", "parameters": {"zone": ', Parsed('{"name": "get_time", "parameters": {"zone": ', [])),
    ('{"city": "Paris"}', Parsed('{"city": "Paris"}', [])),
    ("The weather is fine {not a call}", Parsed("The weather is fine {not a call}", [])),
    ("   ", Parsed("   ", [])),
]


@pytest.mark.parametrize(("text", "expected"), HERMES_CASES)
def test_hermes(text, expected):
    assert parse(HermesToolParser(), text) == expected


@pytest.mark.parametrize(("text", "expected"), LLAMA3_CASES)
def test_llama3_json(text, expected):
    assert parse(Llama3JsonToolParser(), text) == expected


def _fed_in_pieces(parser, text: str, rng: random.Random) -> Parsed:
    content, calls = [], []
    pos = 0
    while pos < len(text):
        step = rng.randint(1, 7)
        out = parser.feed(text[pos : pos + step])
        content.append(out.content)
        calls += out.calls
        pos += step
    out = parser.finish()
    return Parsed("".join(content) + out.content, calls + out.calls)


@pytest.mark.parametrize("cls", [HermesToolParser, Llama3JsonToolParser])
def test_streamed_equals_whole(cls):
    cases = HERMES_CASES if cls is HermesToolParser else LLAMA3_CASES
    rng = random.Random(0)
    for text, expected in cases:
        for _ in range(20):
            assert _fed_in_pieces(cls(), text, rng) == expected, text


def test_streaming_releases_content_before_the_call_and_holds_the_call():
    parser = HermesToolParser()
    assert parser.feed("Checking the weather") == Parsed("Checking the weather", [])
    assert parser.feed(" now.\n<tool") == Parsed(" now.", [])  # the newline and a possible tag start are held
    assert parser.feed('_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}') == Parsed("", [])
    assert parser.feed("\n</tool_call>\n") == Parsed("", [TIME])
    assert parser.finish() == Parsed("", [])


def test_llama3_plain_text_streams_at_once():
    parser = Llama3JsonToolParser()
    assert parser.feed("  ") == Parsed("", [])
    assert parser.feed("Hello") == Parsed("  Hello", [])
    assert parser.feed(" {x}") == Parsed(" {x}", [])


def test_arguments_are_canonical_json():
    out = parse(HermesToolParser(), '<tool_call>{"name":"f","arguments":{"b":[1,2],"a":"é"}}</tool_call>')
    assert out.calls == [ToolCall("f", '{"b": [1, 2], "a": "é"}')]
    assert json.loads(out.calls[0].arguments) == {"b": [1, 2], "a": "é"}


def test_registry():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json"]
    assert tool_parser_class("hermes") is HermesToolParser
    with pytest.raises(KeyError, match="known: \\['hermes', 'llama3_json'\\]"):
        tool_parser_class("mistral")
