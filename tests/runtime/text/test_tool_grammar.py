"""The constraint behind tool_choice "required" and a named function, compiled by xgrammar against SmolLM2's
tokenizer: a matcher accepts a call in the parser's format whose arguments match the schema (then only EOS), and
rejects wrong arguments, an unknown function, text before the call, a second call when calls are not parallel."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from runtime.text.tool_parsers import HermesToolParser, ToolParser, parse
from runtime.text.tool_parsers.grammar import FunctionSpec, tool_call_constraint
from runtime.text.tool_parsers.llama3_json import Llama3JsonToolParser

CITY = FunctionSpec(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
)
ZONE = FunctionSpec("get_time", {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}})
NOW = FunctionSpec("now", None)


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(smollm2_tokenizer, vocab_size=len(smollm2_tokenizer))
    return xgr.GrammarCompiler(info)


def _matcher(compiler, parser: type[ToolParser], functions: list[FunctionSpec], parallel: bool):
    constraint = tool_call_constraint(parser, functions, parallel)
    assert constraint.kind == "structural_tag"
    return xgr.GrammarMatcher(compiler.compile_structural_tag(constraint.structural_tag))


def _call(parser: type[ToolParser], name: str, args: dict) -> str:
    fmt = parser.call_format(name)
    return fmt.begin + json.dumps(args) + fmt.end


def _accepts_whole(matcher, text: str, eos: int) -> bool:
    return matcher.accept_string(text) and matcher.accept_token(eos) and matcher.is_terminated()


@pytest.mark.parametrize("parser", [HermesToolParser, Llama3JsonToolParser])
def test_a_valid_call_is_accepted_and_parses(compiler, smollm2_tokenizer, parser):
    eos = smollm2_tokenizer.eos_token_id
    text = _call(parser, "get_weather", {"city": "Paris", "days": 3})
    assert _accepts_whole(_matcher(compiler, parser, [CITY, ZONE, NOW], parallel=False), text, eos)
    calls = parse(parser(), text).calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize("parser", [HermesToolParser, Llama3JsonToolParser])
@pytest.mark.parametrize(
    "text",
    [
        _call(HermesToolParser, "get_weather", {"city": "Paris", "days": 9}),  # maximum
        _call(HermesToolParser, "get_weather", {"city": "Paris"}),  # required
        _call(HermesToolParser, "get_weather", {"city": "Paris", "days": 1, "x": 1}),  # additionalProperties
        _call(HermesToolParser, "get_time", {"zone": "PST"}),  # enum
        _call(HermesToolParser, "delete_all", {}),  # no such function
        "Sure! " + _call(HermesToolParser, "now", {}),  # text before the call
    ],
)
def test_invalid_calls_are_rejected(compiler, smollm2_tokenizer, parser, text):
    if parser is Llama3JsonToolParser:  # the same mistakes in the other format
        text = text.replace("<tool_call>\n", "").replace("\n</tool_call>", "").replace('"arguments"', '"parameters"')
    matcher = _matcher(compiler, parser, [CITY, ZONE, NOW], parallel=True)
    assert not _accepts_whole(matcher, text, smollm2_tokenizer.eos_token_id)


def test_parallel_calls(compiler, smollm2_tokenizer):
    eos = smollm2_tokenizer.eos_token_id
    fmt = HermesToolParser.call_format("now")
    two = _call(HermesToolParser, "now", {}) + fmt.separator + _call(HermesToolParser, "get_time", {"zone": "UTC"})
    assert _accepts_whole(_matcher(compiler, HermesToolParser, [ZONE, NOW], parallel=True), two, eos)
    assert not _accepts_whole(_matcher(compiler, HermesToolParser, [ZONE, NOW], parallel=False), two, eos)
    assert not _accepts_whole(_matcher(compiler, HermesToolParser, [ZONE, NOW], parallel=True), "", eos)  # >= 1


def test_named_function_admits_only_it(compiler, smollm2_tokenizer):
    eos = smollm2_tokenizer.eos_token_id
    named = _matcher(compiler, HermesToolParser, [ZONE], parallel=False)
    assert _accepts_whole(named, _call(HermesToolParser, "get_time", {"zone": "CET"}), eos)
    other = _matcher(compiler, HermesToolParser, [ZONE], parallel=False)
    assert not _accepts_whole(other, _call(HermesToolParser, "now", {}), eos)


def test_no_function_is_an_error():
    with pytest.raises(ValueError, match="at least one function"):
        tool_call_constraint(HermesToolParser, [], parallel=True)
