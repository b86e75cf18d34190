"""The HTTP server's pure parts, without a server: request decoding (accepted, unsupported and unknown fields), the
mapping onto SamplingParams, the OpenAI error shape of every client-library error, and the answer bodies."""

from __future__ import annotations

import orjson
import pytest

from runtime import protocol as p
from runtime.client.errors import (
    ContextLengthError,
    InvalidInputError,
    MalformedRequestError,
    ServerFailedError,
    ServerGoneError,
)
from runtime.sampling_params import INT32_MAX, InvalidSamplingParams, SamplingParams
from runtime.serve.http import extra_fields
from runtime.serve.http.errors import OpenAIError, from_exception
from runtime.serve.http.openai_schema import (
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    completion_prompts,
    decode,
)
from runtime.serve.http.request_map import chat_request, completion_requests
from runtime.serve.http.responses import chat_logprobs, completion_logprobs, usage_body

MSG = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return decode(orjson.dumps({"messages": MSG, **fields}), ChatCompletionRequest)


def error_of(body: bytes, cls=ChatCompletionRequest) -> tuple[int, str, str | None, str | None]:
    with pytest.raises(OpenAIError) as info:
        decode(body, cls)
    e = info.value
    return e.status, e.type, e.code, e.param


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b"{not json", "invalid_json", None),
        (b'{"messages": [], "model": "\xff"}', "invalid_json", None),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "invalid_json", None),  # a lone surrogate
        (b"[1, 2]", "invalid_type", None),
        (b'{"messages": [], "max_tokens": "10"}', "invalid_type", "max_tokens"),
        (b'{"messages": [], "n": true}', "invalid_type", "n"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "invalid_type", "messages[0].content"),
        (b'{"max_tokens": 3}', "missing_required_parameter", "messages"),
        (b'{"messages": [], "functions": [{"name": "f"}]}', "unsupported_parameter", "functions"),
        (b'{"messages": [], "prediction": {"type": "content", "content": "x"}}', "unsupported_parameter", "prediction"),
        (b'{"messages": [], "logit_bias": {"five": 10}}', "invalid_type", "logit_bias"),
        (b'{"messages": [], "echo": true}', "unsupported_parameter", "echo"),
        (b'{"messages": [], "audio": {"voice": "x"}}', "unsupported_parameter", "audio"),
        (b'{"messages": [], "modalities": ["text", "audio"]}', "unsupported_parameter", "modalities"),
        (b'{"messages": [], "prediction": {"type": "content", "content": "x"}}', "unsupported_parameter", "prediction"),
        (b'{"messages": [], "web_search_options": {}}', "unsupported_parameter", "web_search_options"),
    ],
)
def test_bad_chat_bodies_are_400_naming_the_field(body, code, param):
    assert error_of(body) == (400, "invalid_request_error", code, param)


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b'{"prompt": "a", "echo": 1}', "invalid_type", "echo"),
        (b'{"prompt": "a", "best_of": 3}', "unsupported_parameter", "best_of"),
        (b'{"prompt": "a", "suffix": "z"}', "unsupported_parameter", "suffix"),
        (b'{"prompt": "a", "logprobs": true}', "invalid_type", "logprobs"),
    ],
)
def test_bad_completion_bodies_are_400_naming_the_field(body, code, param):
    assert error_of(body, CompletionRequest) == (400, "invalid_request_error", code, param)


def test_unknown_fields_are_dropped_and_each_name_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(extra_fields, "_logged", set())  # names logged by earlier tests of this process
    body = {
        "messages": [
            {"role": "assistant", "content": "a", "reasoning_content": "r"},
            {"role": "user", "content": [{"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}]},
        ],
        "temprature": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True, "x_later_option": 1},
    }
    with caplog.at_level("WARNING", logger="runtime.serve.http.extra_fields"):
        for _ in range(3):
            req = decode(orjson.dumps(body), ChatCompletionRequest)
    assert req.temperature is None and req.stream_options.include_usage is True
    assert chat_messages(req.messages) == [p.ChatMessage("assistant", "a"), p.ChatMessage("user", "b")]
    logged = sorted(r.getMessage() for r in caplog.records)
    assert logged == [
        f"ignoring the unknown field {name!r} in {where} (logged once per name)"
        for name, where in sorted(
            [
                ("cache_control", "messages[].content[]"),
                ("reasoning_content", "messages[]"),
                ("temprature", "request"),
                ("x_later_option", "stream_options"),
            ],
            key=lambda nw: f"ignoring the unknown field {nw[0]!r} in {nw[1]} (logged once per name)",
        )
    ]


def test_every_unsupported_field_is_declared_so_the_unknown_field_rule_cannot_swallow_it():
    declared = set(ChatCompletionRequest.__struct_fields__) | set(CompletionRequest.__struct_fields__)
    assert set(UNSUPPORTED) <= declared


def test_neutral_values_of_unsupported_fields_and_harmless_fields_are_accepted():
    req = chat(
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        logit_bias={},
        user="u",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        parallel_tool_calls=True,
        modalities=["text"],
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
        stop=None,
        temperature=None,
    )
    assert chat_request(req, "r").sampling_params == SamplingParams(max_tokens=INT32_MAX)
    assert chat_request(req, "r").include_usage is True


def test_chat_fields_map_onto_sampling_params():
    req = chat(
        max_tokens=5,
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        min_p=0.1,
        n=2,
        seed=3,
        stop="x",
        stop_token_ids=[9],
        ignore_eos=True,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.2,
        logprobs=True,
        top_logprobs=3,
        cache_salt="tenant",
        user="ignored",
    )
    backend = chat_request(req, "r")
    assert backend.sampling_params == SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        min_p=0.1,
        n=2,
        seed=3,
        stop=["x"],
        stop_token_ids=[9],
        ignore_eos=True,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.2,
        logprobs=3,
    )
    assert backend.request == p.GenerateRequest(
        rid="r",
        messages=[p.ChatMessage("user", "hi")],
        sampling_params=backend.sampling_params,
        stream=True,
        cache_salt="tenant",
    )
    assert backend.param_names == {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}
    assert chat_request(chat(logprobs=True), "r").sampling_params.logprobs == 0
    assert chat_request(chat(logprobs=False), "r").sampling_params.logprobs is None


def test_completion_fields_map_onto_sampling_params():
    req = decode(b'{"prompt": [5, 6, 7], "logprobs": 2, "stop": ["a", "b"]}', CompletionRequest)
    (backend,) = completion_requests(req, "r")
    assert (backend.request.prompt, backend.request.input_ids) == (None, [5, 6, 7])
    assert backend.sampling_params == SamplingParams(max_tokens=16, logprobs=2, stop=["a", "b"])


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("text", [("text", None)]),
        ([1, 2], [(None, [1, 2])]),
        (["text"], [("text", None)]),
        ([[3, 4]], [(None, [3, 4])]),
        (["a", [5], "b"], [("a", None), (None, [5]), ("b", None)]),
        ([[1], [2]], [(None, [1]), (None, [2])]),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    assert completion_prompts(prompt) == expected


@pytest.mark.parametrize(
    ("prompt", "code"),
    [
        ([], "invalid_value"),
        (["a"] * 1025, "invalid_value"),
        ([1, "a"], "invalid_type"),
        ([True], "invalid_type"),
        (["a", []], "invalid_type"),
        ([[1, "x"]], "invalid_type"),
    ],
)
def test_bad_completion_prompts(prompt, code):
    with pytest.raises(OpenAIError) as info:
        completion_prompts(prompt)
    assert (info.value.status, info.value.code, info.value.param) == (400, code, "prompt")


def test_a_list_of_prompts_is_one_backend_request_each():
    req = decode(b'{"prompt": ["a", [7, 8]], "n": 2, "max_tokens": 3}', CompletionRequest)
    backend = completion_requests(req, "r")
    assert [(b.request.rid, b.request.prompt, b.request.input_ids) for b in backend] == [
        ("r-0", "a", None),
        ("r-1", None, [7, 8]),
    ]
    assert [b.sampling_params for b in backend] == [SamplingParams(max_tokens=3, n=2)] * 2


def test_chat_messages_roles_and_parts():
    msgs = decode(
        orjson.dumps(
            {
                "messages": [
                    {"role": "developer", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                    {"role": "assistant", "content": "c", "name": "bot"},
                ]
            }
        ),
        ChatCompletionRequest,
    ).messages
    assert chat_messages(msgs) == [
        p.ChatMessage("system", "be brief"),
        p.ChatMessage("user", "ab"),
        p.ChatMessage("assistant", "c"),
    ]


@pytest.mark.parametrize(
    ("message", "code", "param"),
    [
        ({"role": "wizard", "content": "x"}, "invalid_value", "messages[0].role"),
        ({"role": "user", "content": "x", "tool_call_id": "1"}, "invalid_value", "messages[0].tool_call_id"),
        ({"role": "tool", "content": "x"}, "missing_required_parameter", "messages[0].tool_call_id"),
        ({"role": "function", "content": "x", "name": "f"}, "unsupported_parameter", "messages[0].role"),
        ({"role": "user", "content": "x", "tool_calls": []}, "invalid_value", "messages[0].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"id": "1"}]}, "invalid_type", "messages[0].tool_calls[0]"),
        ({"role": "assistant", "content": None}, "missing_required_parameter", "messages[0].content"),
        ({"role": "user"}, "missing_required_parameter", "messages[0].content"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
            "unsupported_parameter",
            "messages[0].content[0].type",
        ),
        ({"role": "user", "content": [{"type": "text"}]}, "invalid_type", "messages[0].content[0]"),
    ],
)
def test_bad_messages(message, code, param):
    msgs = decode(orjson.dumps({"messages": [message]}), ChatCompletionRequest).messages
    with pytest.raises(OpenAIError) as info:
        chat_messages(msgs)
    assert (info.value.status, info.value.code, info.value.param) == (400, code, param)


def test_empty_messages_and_request_level_rules():
    for req, param in [
        (chat(messages=[]), "messages"),
        (chat(top_logprobs=2), "top_logprobs"),
        (chat(stream_options={"include_usage": True}), "stream_options"),
    ]:
        with pytest.raises(OpenAIError) as info:
            chat_request(req, "r")
        assert (info.value.status, info.value.code, info.value.param) == (400, "invalid_value", param)


def test_an_out_of_range_value_is_a_400_naming_its_request_field():
    """SamplingParams are built, so validated, where the body is mapped: the error names the OpenAI field."""
    cases = [
        (chat(max_completion_tokens=0), "max_completion_tokens", "must be in [1, 2147483647], got 0"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs", "must be in [0, 20], got 21"),
        (chat(temperature=-1.0), "temperature", "must be finite and in [0, 10000], got -1.0"),
    ]
    for req, param, message in cases:
        with pytest.raises(OpenAIError) as info:
            chat_request(req, "r")
        e = info.value
        assert (e.status, e.code, e.param, e.message) == (400, "invalid_value", param, f"{param} {message}")
    with pytest.raises(OpenAIError) as info:
        completion_requests(decode(b'{"prompt": "a", "n": 0}', CompletionRequest), "r")
    assert (info.value.param, info.value.message) == ("n", "n must be in [1, 64], got 0")


def test_client_errors_become_openai_errors():
    with pytest.raises(InvalidSamplingParams) as bad:
        SamplingParams(max_tokens=0)
    e = from_exception(bad.value, {"max_tokens": "max_completion_tokens"}, "messages")
    assert (e.status, e.type, e.code, e.param) == (
        400,
        "invalid_request_error",
        "invalid_value",
        "max_completion_tokens",
    )
    assert e.message == "max_completion_tokens must be in [1, 2147483647], got 0"
    cases = [
        (ContextLengthError("r", p.ERR_CONTEXT, "too long"), (400, "invalid_request_error", p.ERR_CONTEXT, "messages")),
        (
            InvalidInputError("messages[0].content is not UTF-8"),
            (400, "invalid_request_error", "invalid_value", "messages"),
        ),
        (ServerGoneError("r", p.ERR_SERVER, "gone"), (503, "service_unavailable_error", "backend_unavailable", None)),
        (ServerFailedError("r", p.ERR_SERVER, "worker died"), (500, "server_error", "server_error", None)),
        (
            MalformedRequestError("r", p.ERR_TOO_LARGE, "too big"),
            (413, "invalid_request_error", p.ERR_TOO_LARGE, "messages"),
        ),
    ]
    for exc, expected in cases:
        e = from_exception(exc, {}, "messages")
        assert (e.status, e.type, e.code, e.param) == expected
        assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_answer_bodies():
    """Logprobs name each token and alternative by the text the backend sent with it (StreamChunk.token_texts);
    bytes are that text as UTF-8."""
    assert usage_body(p.Usage(10, 4, 3)) == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    lps = [p.TokenLogprobs(-0.5, [1, 3], [-0.5, -1.0]), None]
    texts = [p.TokenText("a", ["a", "bc"]), p.TokenText("é", [])]
    assert chat_logprobs([1, 2], lps, texts) == {
        "content": [
            {
                "token": "a",
                "logprob": -0.5,
                "bytes": [97],
                "top_logprobs": [
                    {"token": "a", "logprob": -0.5, "bytes": [97]},
                    {"token": "bc", "logprob": -1.0, "bytes": [98, 99]},
                ],
            },
            {"token": "é", "logprob": -9999.0, "bytes": [195, 169], "top_logprobs": []},
        ]
    }
    lps = [p.TokenLogprobs(float("-inf"), [3], [-2.0]), p.TokenLogprobs(-0.25, [], [])]
    texts = [p.TokenText("bc", ["bc"]), p.TokenText("a", [])]
    assert completion_logprobs([3, 1], lps, texts, offset=5) == {
        "tokens": ["bc", "a"],
        "token_logprobs": [-9999.0, -0.25],
        "top_logprobs": [{"bc": -2.0}, {}],
        "text_offset": [5, 7],
    }
    # a backend without a tokenizer sends no texts: tokens read "token_id:<id>" (vLLM's spelling)
    assert completion_logprobs([7], [p.TokenLogprobs(-1.0, [7, 9], [-1.0, -2.0])], None) == {
        "tokens": ["token_id:7"],
        "token_logprobs": [-1.0],
        "top_logprobs": [{"token_id:7": -1.0, "token_id:9": -2.0}],
        "text_offset": [0],
    }
