"""Chat template options and the shipped ChatML tool template: tools rendered in the system turn, tool calls and tool
results in the history, chats without tools rendered exactly as SmolLM2's own template, chat_template_kwargs,
add_generation_prompt, continue_final_message, the template chosen for tools, --chat-template files."""

from __future__ import annotations

import copy
import json

import pytest

from runtime import protocol as p
from runtime.config import InvalidConfig, ServerArgs
from runtime.text.chat_templates import (
    CHATML_TOOLS,
    ChatTemplateFileError,
    chatml_tool_template,
    override_chat_template,
    read_chat_template,
    template_for,
)
from runtime.text.prompt import ChatTemplateError, encode_prompt
from runtime.text.tool_parsers import HermesToolParser, ToolCall, parse

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = p.ChatToolCall("call_1", "get_weather", '{"city": "Paris"}')
HISTORY = [
    p.ChatMessage("user", "Weather in Paris?"),
    p.ChatMessage("assistant", None, [CALL]),
    p.ChatMessage("tool", "18 C, sunny", tool_call_id="call_1"),
]
PLAIN_CHATS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
]


def _text(tok, messages, **options) -> str:
    return tok.decode(encode_prompt(tok, messages=messages, chat_options=p.ChatOptions(**options)))


@pytest.mark.parametrize("chat", PLAIN_CHATS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_tool_template_renders_plain_chats_as_smollm2_does(smollm2_tokenizer, chat, generation_prompt):
    tok = smollm2_tokenizer
    own = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
    shipped = tok.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=generation_prompt, chat_template=chatml_tool_template()
    )
    assert shipped == own


def test_tools_history_and_results_rendered(smollm2_tokenizer):
    text = _text(smollm2_tokenizer, HISTORY, tools=[WEATHER])
    signature = json.dumps(WEATHER["function"], ensure_ascii=False)
    assert text.startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n\n"
        "You can call functions to answer."
    )
    assert f"<tools>\n{signature}\n</tools>\n" in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_call_in_the_parsers_format_renders_back_as_written(smollm2_tokenizer):
    """The grammar writes a call as HermesToolParser.call_format says; the next turn renders the same text, so the
    prefix cache reuses the call's KV."""
    fmt = HermesToolParser.call_format("get_weather")
    written = fmt.begin + '{"city": "Paris"}' + fmt.end
    assert parse(HermesToolParser(), written).calls == [ToolCall("get_weather", '{"city": "Paris"}')]
    text = _text(smollm2_tokenizer, HISTORY[:2], tools=[WEATHER], add_generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\n" + written + "<|im_end|>\n")


def test_several_calls_with_content(smollm2_tokenizer):
    calls = [CALL, p.ChatToolCall("call_2", "get_weather", '{"city": "Oslo"}')]
    text = _text(smollm2_tokenizer, [p.ChatMessage("assistant", "Both:", calls)], add_generation_prompt=False)
    assert text.endswith(
        '<|im_start|>assistant\nBoth:\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
    )


def test_generation_prompt_and_continue_final_message(smollm2_tokenizer):
    chat = [p.ChatMessage("user", "Hi"), p.ChatMessage("assistant", "Hello the")]
    closed = _text(smollm2_tokenizer, chat, add_generation_prompt=False)
    assert closed.endswith("<|im_start|>assistant\nHello the<|im_end|>\n")
    assert _text(smollm2_tokenizer, chat).endswith("Hello the<|im_end|>\n<|im_start|>assistant\n")
    continued = _text(smollm2_tokenizer, chat, add_generation_prompt=False, continue_final_message=True)
    assert continued.endswith("<|im_start|>assistant\nHello the")
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        _text(smollm2_tokenizer, chat, continue_final_message=True)


def test_chat_template_kwargs_reach_the_template(smollm2_tokenizer):
    tok = copy.copy(smollm2_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking %}<think>{% endif %}"
    )
    chat = [p.ChatMessage("user", "Hi")]
    assert _text(tok, chat, chat_template_kwargs={"enable_thinking": True}) == "Hi<think>"
    assert _text(tok, chat, chat_template_kwargs={"enable_thinking": False}) == "Hi"
    with pytest.raises(ChatTemplateError, match=r"may not set \['chat_template', 'tools'\]"):
        _text(tok, chat, chat_template_kwargs={"tools": [], "chat_template": "x", "ok": 1})


def test_template_choice_for_tools():
    chatml = "{{ '<|im_start|>' }}"
    assert template_for(chatml, tools=False) == chatml
    assert template_for(chatml, tools=True) == chatml_tool_template()
    own_tools = "{% if tools %}{{ tools | tojson }}{% endif %}<|im_start|>"
    assert template_for(own_tools, tools=True) == own_tools
    assert template_for("[INST]{{ messages }}", tools=True) is None


def test_a_template_without_tools_is_refused_for_tools(smollm2_tokenizer, tmp_path):
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    tok = override_chat_template(copy.copy(smollm2_tokenizer), str(path))
    assert _text(tok, [p.ChatMessage("user", "Hi")]) == "[user] Hi\n"
    with pytest.raises(ChatTemplateError, match="does not render tools; start the server with --chat-template"):
        _text(tok, [p.ChatMessage("user", "Hi")], tools=[WEATHER])


def test_chat_template_files(tmp_path):
    assert read_chat_template(CHATML_TOOLS) == chatml_tool_template()
    with pytest.raises(ChatTemplateFileError, match="cannot be read"):
        read_chat_template(tmp_path / "missing.jinja")
    with pytest.raises(InvalidConfig, match="chat_template must be a readable file"):
        ServerArgs(chat_template=str(tmp_path / "missing.jinja"))
    assert ServerArgs(chat_template=str(CHATML_TOOLS)).chat_template == str(CHATML_TOOLS)


def test_chat_options_check():
    assert p.ChatOptions().check() is None
    req = p.GenerateRequest(rid="r", prompt="x", chat_options=p.ChatOptions())
    assert req.check() == "chat_options need messages"
    both = p.ChatOptions(continue_final_message=True)
    assert p.GenerateRequest(rid="r", messages=[p.ChatMessage("user", "x")], chat_options=both).check() == (
        "add_generation_prompt and continue_final_message cannot both be true"
    )
