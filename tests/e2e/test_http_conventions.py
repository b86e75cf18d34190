"""The conventions of the servers users come from, driven by the real openai SDK (raw HTTP where the SDK cannot say
it): extra fields ignored and logged once, unimplemented known fields a 400 naming them, X-Request-Id honoured and
echoed, GET /v1/models/{id}, CORS preflights, the API key on /v1/* only, one log line per rejected request, and no
empty delta mid-stream. One HTTP server in front of the tiny e2e server, with an API key and CORS."""

from __future__ import annotations

import json
import re
import urllib.parse
from http.client import HTTPConnection

import openai
import pytest

from tests.e2e.http_servers import MODEL, msgs, salt, start_tiny_http

KEY = "sk-conventions"
ORIGIN = "https://ui.example"
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def http(tiny_server, tiny_llama_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    flags = ("--allowed-origins", f"{ORIGIN},https://other.example", "--max-model-len", str(MAX_MODEL_LEN))
    server = start_tiny_http(tiny_server, tiny_llama_dir, logs, *flags, env={"RADIXSERVE_API_KEY": KEY})
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def oai(http):
    with http.openai(api_key=KEY) as client:
        yield client


def raw(url: str, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    """(status, headers as a lower-case dict, body bytes) of one request on its own connection."""
    u = urllib.parse.urlsplit(url)
    conn = HTTPConnection(u.hostname, u.port, timeout=60)
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def log_lines(http, pattern: str) -> list[str]:
    return [line for line in http.log.read_text().splitlines() if re.search(pattern, line)]


def test_extra_fields_are_ignored_and_each_name_logged_once(oai, http):
    plain = msgs("extra fields")
    extra = [
        {"role": "system", "content": "You are terse.", "reasoning_content": "thinking"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "extra fields", "cache_control": {"type": "ephemeral"}}],
        },
    ]
    ref = oai.chat.completions.create(
        model=MODEL, messages=plain, max_tokens=6, temperature=0.0, extra_body={"cache_salt": salt()}
    )
    for _ in range(2):
        r = oai.chat.completions.create(
            model=MODEL,
            messages=extra,
            max_tokens=6,
            temperature=0.0,
            extra_body={"cache_salt": salt(), "guided_decoding_backend_x": "auto", "priority_x": 3},
        )
        assert r.choices[0].message.content == ref.choices[0].message.content
        assert r.usage.prompt_tokens == ref.usage.prompt_tokens
    for name, where in [
        ("guided_decoding_backend_x", "request"),
        ("priority_x", "request"),
        ("reasoning_content", r"messages\[\]"),
        ("cache_control", r"messages\[\]\.content\[\]"),
    ]:
        assert len(log_lines(http, rf"ignoring the unknown field '{name}' in {where} ")) == 1, name


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prediction", {"type": "content", "content": "x"}),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("web_search_options", {}),
    ],
)
def test_a_known_field_the_server_does_not_implement_is_a_400_naming_it(oai, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=msgs("x"), max_tokens=2, extra_body={field: value})
    assert (info.value.status_code, info.value.code, info.value.param) == (400, "unsupported_parameter", field)


def test_x_request_id_is_honoured_and_echoed(oai):
    raw_answer = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs("rid"), max_tokens=2, extra_headers={"X-Request-Id": "agent-7.turn:3"}
    )
    assert raw_answer.headers["x-request-id"] == "agent-7.turn:3"
    assert raw_answer.parse().id == "chatcmpl-agent-7.turn:3"
    with oai.completions.with_streaming_response.create(
        model=MODEL, prompt="rid", max_tokens=3, stream=True, extra_headers={"X-Request-Id": "stream-1"}
    ) as streamed:
        assert streamed.headers["x-request-id"] == "stream-1"
        assert {chunk.id for chunk in streamed.parse()} == {"cmpl-stream-1"}
    invalid = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs("rid"), max_tokens=2, extra_headers={"X-Request-Id": "has space"}
    )
    made = invalid.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made) and invalid.parse().id == f"chatcmpl-{made}"


def test_models_by_id_with_max_model_len(oai, http, tiny_llama_dir):
    card = oai.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "radixserve")
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert card.model_extra["root"] == str(tiny_llama_dir)
    assert [m.model_extra["max_model_len"] for m in oai.models.list().data] == [MAX_MODEL_LEN]
    assert oai.models.retrieve(str(tiny_llama_dir)).id == MODEL  # the model argument is an alias
    with pytest.raises(openai.NotFoundError) as info:
        oai.models.retrieve("gpt-4o")
    assert (info.value.code, info.value.param) == ("model_not_found", "model")


def test_cors_preflight_is_answered_without_the_key(http):
    status, headers, _ = raw(
        http.url,
        "OPTIONS",
        "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert status == 200
    assert headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    auth = {"Authorization": f"Bearer {KEY}", "Origin": ORIGIN}
    status, headers, _ = raw(http.url, "GET", "/v1/models", headers=auth)
    assert (status, headers["access-control-allow-origin"]) == (200, ORIGIN)
    assert "x-request-id" in headers["access-control-expose-headers"].lower()
    status, headers, _ = raw(http.url, "GET", "/v1/models", headers={**auth, "Origin": "https://evil.example"})
    assert status == 200 and "access-control-allow-origin" not in headers


def test_the_api_key_guards_v1_only(http):
    for path in ("/v1/models", f"/v1/models/{MODEL}", "/v1/nope"):
        assert raw(http.url, "GET", path)[0] == 401, path
    assert raw(http.url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 401
    assert raw(http.url, "GET", "/health")[0] == 200
    assert raw(http.url, "GET", "/metrics")[0] == 200
    status, _, body = raw(http.url, "POST", "/tokenize", {"prompt": "hello"})
    assert status == 200 and json.loads(body)["count"] >= 1


def test_each_rejected_request_is_logged_once_with_its_id_and_reason(http):
    auth = {"Authorization": f"Bearer {KEY}"}
    status, headers, _ = raw(
        http.url,
        "POST",
        "/v1/chat/completions",
        {"messages": msgs("x"), "temperature": -1},
        {**auth, "X-Request-Id": "rejected-400"},
    )
    assert (status, headers["x-request-id"]) == (400, "rejected-400")
    assert raw(http.url, "GET", "/v1/models", headers={"X-Request-Id": "rejected-401"})[0] == 401
    assert raw(http.url, "GET", "/v1/models/nope", headers={**auth, "X-Request-Id": "rejected-404"})[0] == 404
    for rid, status in (("rejected-400", 400), ("rejected-401", 401), ("rejected-404", 404)):
        lines = log_lines(http, f"request id {rid}:")
        assert len(lines) == 1, lines
        assert f"status {status}" in lines[0]
    assert "temperature" in log_lines(http, "request id rejected-400:")[0]


def test_no_empty_delta_mid_stream(oai, zmq):
    """A token without text of its own (a special token, part of a UTF-8 character) makes the backend send a chunk
    without text (the reference below has one); it becomes no `delta: {}` event."""
    request = {"max_tokens": 40, "temperature": 0.0}
    messages = msgs("no empty deltas 3")
    ref = list(zmq.stream(messages=messages, cache_salt=salt(), ignore_eos=True, **request))
    assert any(not c.text and c.finish_reason is None for c in ref[1:])
    events = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            extra_body={"cache_salt": salt(), "ignore_eos": True},
            **request,
        )
    )
    assert events[0].choices[0].delta.role == "assistant"
    assert all(e.choices[0].delta.content or e.choices[0].finish_reason for e in events[1:])
    assert "".join(e.choices[0].delta.content or "" for e in events) == "".join(c.text for c in ref)


def test_a_list_of_prompts_gives_one_choice_per_prompt_and_sample(oai, zmq):
    prompts = ["list prompts one", [500, 501, 502], "list prompts three"]
    sampled = {"temperature": 1.0, "seed": 11, "n": 2, "max_tokens": 5}
    refs = []
    for prompt in prompts:
        form = {"prompt": prompt} if isinstance(prompt, str) else {"input_ids": prompt}
        refs.append(zmq.generate(cache_salt=salt(), **form, **sampled))
    r = oai.completions.create(model=MODEL, prompt=prompts, extra_body={"cache_salt": salt()}, **sampled)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [c.text for ref in refs for c in ref.choices]
    assert r.usage.prompt_tokens == sum(ref.usage.prompt_tokens for ref in refs)
    assert r.usage.completion_tokens == sum(ref.usage.completion_tokens for ref in refs) == 30
    stream = oai.completions.create(
        model=MODEL,
        prompt=prompts,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"cache_salt": salt()},
        **sampled,
    )
    texts = [""] * 6
    finished = []
    for chunk in stream:
        if not chunk.choices:
            assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (
                r.usage.prompt_tokens,
                r.usage.completion_tokens,
            )
            continue
        choice = chunk.choices[0]
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished.append(choice.index)
    assert texts == [c.text for c in r.choices]
    assert sorted(finished) == list(range(6))


def test_continuous_usage_stats_put_the_usage_on_every_chunk(oai):
    """With logprobs each chunk names its tokens, so the usage of every chunk is checked exactly: prompt tokens as
    the final usage says, completion tokens the tokens sent so far."""
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=msgs("continuous usage"),
        max_tokens=12,
        temperature=0.0,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "cache_salt": salt()},
    )
    *chunks, last = list(stream)
    assert last.choices == [] and last.usage.completion_tokens == 12
    sent = 0
    for chunk in chunks:
        sent += len(chunk.choices[0].logprobs.content) if chunk.choices[0].logprobs else 0
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (last.usage.prompt_tokens, sent)
        assert chunk.usage.total_tokens == last.usage.prompt_tokens + sent
    assert sent == 12
    plain = oai.completions.create(
        model=MODEL,
        prompt="continuous usage",
        max_tokens=3,
        stream=True,
        stream_options={"continuous_usage_stats": True},  # without include_usage: nothing (vLLM's rule)
    )
    assert all(chunk.usage is None for chunk in plain)
