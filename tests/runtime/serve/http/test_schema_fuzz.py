"""Fuzz of the HTTP request decoder (issue 28, class 3), as test_frame_fuzz does for the ZeroMQ frames: JSON bodies of
every shape, maps shaped like each OpenAI request with random values in each field, nesting far past the decoder's
recursion limit, and random bytes. decode (and the mapping onto a GenerateRequest, for what decodes) must return or
raise OpenAIError with status 400, never anything else: whatever a body is, the answer is a 400 in the OpenAI shape.

Before: a body nested ~100k deep raised RecursionError out of msgspec, a 500 in plain text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.serve.http.errors import OpenAIError
from runtime.serve.http.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    decode,
)
from runtime.serve.http.request_map import chat_request, completion_requests

CLASSES = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)
ints = st.integers(-(2**70), 2**70) | st.sampled_from([-1, 0, 1, 20, 21, 2**31 - 1, 2**31, 2**63, 2**64])
floats = st.floats(allow_nan=False, allow_infinity=False)
scalars = st.none() | st.booleans() | ints | floats | st.text(max_size=12)
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])},
        optional={
            "content": st.text(max_size=12)
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text()}))
            | values
        },
    ),
    max_size=3,
)
_fields = {
    "model": st.text(max_size=6) | values,
    "messages": messages | values,
    "prompt": st.text(max_size=12) | st.lists(ints, max_size=4) | values,
    "tokens": st.lists(ints, max_size=4) | values,
    "max_tokens": ints | values,
    "max_completion_tokens": ints,
    "temperature": floats | ints | values,
    "top_p": floats,
    "top_k": ints,
    "n": ints,
    "seed": ints,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=5) | values,
    "logprobs": st.booleans() | ints,
    "top_logprobs": ints,
    "stream": st.booleans() | values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}) | values,
    "use_beam_search": st.booleans(),
    "tools": values,
    "response_format": values,
    "colour": values,
}
shaped = st.fixed_dictionaries({}, optional=_fields)


def deep(depth: int, opener: bytes, closer: bytes) -> bytes:
    """A chat body with a field the schema types Any (tools) nested depth deep."""
    return b'{"messages": [{"role": "user", "content": "hi"}], "tools": ' + opener * depth + closer * depth + b"}"


def check(body: bytes) -> None:
    """decode, then map, under every request class: a result or a 400 OpenAIError."""
    for cls in CLASSES:
        try:
            req = decode(body, cls)
            if cls is ChatCompletionRequest:
                chat_request(req, "rid")
            elif cls is CompletionRequest:
                completion_requests(req, "rid")
        except OpenAIError as exc:
            assert exc.status == 400, exc.body()
            assert set(exc.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("depth", [10, 1_000, 100_000, 1_000_000])
@pytest.mark.parametrize(("opener", "closer"), [(b"[", b"]"), (b'{"a":', b"}")])
def test_deep_nesting_is_a_400_invalid_json(depth, opener, closer):
    body = deep(depth, opener, closer)
    check(body)
    if depth >= 100_000:
        with pytest.raises(OpenAIError) as info:
            decode(body, ChatCompletionRequest)
        assert (info.value.status, info.value.code) == (400, "invalid_json")
        assert "nests too deeply" in info.value.message


@settings(max_examples=300, deadline=None)
@given(shaped)
def test_shaped_bodies(body):
    check(json.dumps(body).encode())


@settings(max_examples=200, deadline=None)
@given(values)
def test_any_json(body):
    check(json.dumps(body).encode())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes(body):
    check(body)
