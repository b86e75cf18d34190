"""Tool calling in process: the Engine renders a chat's tools (ChatOptions) and, under the grammar of tool_choice
"required", even the tiny random model writes only calls that parse and whose arguments validate."""

from __future__ import annotations

import json

import jsonschema
import pytest

from runtime import protocol as p
from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from runtime.text.prompt import encode_prompt
from runtime.text.tool_parsers import HermesToolParser, parse
from runtime.text.tool_parsers.grammar import FunctionSpec, tool_call_constraint
from tests.runtime.engine_helpers import assert_idle

# bounded schemas: enums and booleans, so a random model's call ends within max_tokens
LIGHT = FunctionSpec(
    "set_light",
    {
        "type": "object",
        "properties": {"room": {"enum": ["kitchen", "hall"]}, "on": {"type": "boolean"}},
        "required": ["room", "on"],
        "additionalProperties": False,
    },
)
MODE = FunctionSpec(
    "set_mode",
    {
        "type": "object",
        "properties": {"mode": {"enum": ["eco", "boost"]}},
        "required": ["mode"],
        "additionalProperties": False,
    },
)
TOOLS = [{"type": "function", "function": {"name": f.name, "parameters": f.parameters}} for f in (LIGHT, MODE)]
SCHEMAS = {f.name: f.parameters for f in (LIGHT, MODE)}


@pytest.mark.slow
def test_engine_renders_tools_and_the_grammar_forces_valid_calls(tiny_llama_dir, smollm2_tokenizer):
    engine = Engine(model=str(tiny_llama_dir), dtype="float32", num_blocks=128)
    messages = [{"role": "user", "content": "Lights on in the kitchen, please."}]
    options = p.ChatOptions(tools=TOOLS)
    constraint = tool_call_constraint(HermesToolParser, [LIGHT, MODE], parallel=False)
    rids = [
        engine.add_request(
            messages=messages,
            chat_options=options,
            sampling_params=SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structured_outputs=constraint),
        )
        for seed in range(4)
    ]
    while engine.stats().num_running or engine.stats().num_waiting:
        engine.step()
    for rid in rids:
        out = engine.result(rid)
        assert out.prompt_token_ids == encode_prompt(smollm2_tokenizer, messages=messages, chat_options=options)
        parsed = parse(HermesToolParser(), out.text)
        assert out.finish_reason == "stop" and parsed.content == "" and len(parsed.calls) == 1, out.text
        call = parsed.calls[0]
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert_idle(engine)
    engine.shutdown()
