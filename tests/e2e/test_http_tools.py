"""Tool calling and the chat-template options through the real openai SDK against the embedded SmolLM2 (float32,
greedy): a two-turn loop (call, tool result, final answer); tool_choice "required" and a named function always give
calls whose arguments validate (jsonschema) over several schemas; streamed equals non-streamed; "none" gives no call
and the text the rendered prompt gives through the ZeroMQ client; add_generation_prompt, continue_final_message and
chat_template_kwargs change the prompt exactly as the template says."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from runtime import protocol as p
from runtime.text.prompt import encode_prompt
from tests.e2e.http_servers import start_http
from tests.e2e.tool_schemas import PARAMETERS, QUESTIONS, TOOLS, WEATHER

MAX_TOKENS = 256  # room for a whole call: a truncated one is content with finish_reason "length", never a call


@pytest.fixture(scope="module")
def smol_http(smol_server, tmp_path_factory):
    """A `python -m runtime.serve.http` in front of smol_server (the hermes parser, the default)."""
    server = start_http(smol_server.endpoint, tmp_path_factory.mktemp("logs") / "http.log", "--model", "smollm2")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def oai(smol_http):
    with openai.OpenAI(base_url=smol_http.url + "/v1", api_key="none", max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def zmq(smol_server):
    with smol_server.client(timeout=300) as c:
        yield c


def _ask(oai, question: str, **fields):
    messages = [{"role": "user", "content": question}]
    return oai.chat.completions.create(
        model="smollm2", messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0.0, **fields
    )


def _valid_calls(message) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, each checked: a fresh call_ id, a known function, arguments valid."""
    out = []
    ids = set()
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.id not in ids
        ids.add(call.id)
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, PARAMETERS[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.mark.slow
def test_two_turn_loop(oai, smol_server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = _ask(oai, "What is the weather in Paris? Answer in celsius.", tool_choice=named)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [name for name, _ in _valid_calls(choice.message)] == ["get_weather"]
    history = [
        {"role": "user", "content": "What is the weather in Paris? Answer in celsius."},
        choice.message.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": c.id, "content": "18 C, sunny"} for c in choice.message.tool_calls),
    ]
    second = oai.chat.completions.create(
        model="smollm2", messages=history, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0.0
    )
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
    assert answer.message.content.strip()
    # the second turn's prompt starts with the first turn's: its blocks come from the prefix cache
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16 - 16


@pytest.mark.slow
@pytest.mark.parametrize(
    ("question", "target"), [("get_weather", "add"), ("add", "book_table"), ("book_table", "get_weather")]
)
def test_required_and_named_calls_validate(oai, question, target):
    """Each schema under "required" (its own question) and under a named choice (another tool's question)."""
    required = _ask(oai, QUESTIONS[question], tool_choice="required", parallel_tool_calls=False).choices[0]
    assert required.finish_reason == "tool_calls" and required.message.content is None
    assert len(_valid_calls(required.message)) == 1
    named = _ask(oai, QUESTIONS[question], tool_choice={"type": "function", "function": {"name": target}}).choices[0]
    assert named.finish_reason == "tool_calls" and named.message.content is None
    assert [name for name, _ in _valid_calls(named.message)] == [target]


@pytest.mark.slow
def test_streamed_equals_non_streamed(oai):
    question = QUESTIONS["add"]
    whole = _ask(oai, question, tool_choice="required").choices[0]
    stream = _ask(oai, question, tool_choice="required", stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.id is not None:  # the head of a call: index, id, type and name, no arguments yet
                    assert d.index == len(calls) and d.type == "function" and d.function.arguments == ""
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    calls[d.index]["arguments"] += d.function.arguments
    assert content == "" and finish == whole.finish_reason == "tool_calls"
    expected = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]
    assert [calls[i] for i in sorted(calls)] == expected


@pytest.mark.slow
def test_none_gives_no_calls_and_the_rendered_prompts_text(oai, zmq, smollm2_tokenizer):
    question = QUESTIONS["get_weather"]
    out = _ask(oai, question, tool_choice="none", max_completion_tokens=16)
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    ids = encode_prompt(
        smollm2_tokenizer, messages=[p.ChatMessage("user", question)], chat_options=p.ChatOptions(tools=TOOLS)
    )
    ref = zmq.generate(input_ids=ids, max_tokens=16, temperature=0.0)
    assert out.usage.prompt_tokens == len(ids)
    assert choice.message.content == ref.text


@pytest.mark.slow
def test_template_options(oai, zmq, smollm2_tokenizer):
    chat = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    cont = oai.chat.completions.create(
        model="smollm2", messages=chat, max_tokens=6, temperature=0.0, extra_body={"continue_final_message": True}
    )
    ids = smollm2_tokenizer.apply_chat_template(chat, continue_final_message=True)["input_ids"]
    assert smollm2_tokenizer.decode(ids).endswith("<|im_start|>assistant\nThe colour is")
    assert cont.usage.prompt_tokens == len(ids)
    assert cont.choices[0].message.content == zmq.generate(input_ids=ids, max_tokens=6, temperature=0.0).text
    closed = oai.chat.completions.create(
        model="smollm2", messages=chat[:1], max_tokens=2, extra_body={"add_generation_prompt": False}
    )
    assert closed.usage.prompt_tokens == len(smollm2_tokenizer.apply_chat_template(chat[:1])["input_ids"])
    kwargs = oai.chat.completions.create(
        model="smollm2",
        messages=chat[:1],
        max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    opened = smollm2_tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True)["input_ids"]
    assert kwargs.usage.prompt_tokens == len(opened)  # SmolLM2's template has no such variable: nothing changes
    for body, param in [
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model="smollm2", messages=chat, max_tokens=2, extra_body=body)
        assert info.value.body["param"] == param


def test_bad_tools_are_400_and_the_server_keeps_serving(oai):
    with pytest.raises(openai.BadRequestError) as info:
        _ask(oai, "hi", tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        _ask(oai, "hi", tool_choice="required", response_format={"type": "json_object"})
    assert info.value.body["param"] == "tool_choice"
    ok = oai.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], max_tokens=4
    )
    assert ok.choices[0].finish_reason in ("stop", "length", "tool_calls")
