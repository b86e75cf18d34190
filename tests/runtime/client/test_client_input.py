"""The client refuses what it cannot send with a typed error naming the field, before anything is sent: text with a
lone surrogate, ints msgpack cannot carry, chat messages of the wrong shape, out-of-range sampling params; and a refused
call leaves no request behind in the client."""

from __future__ import annotations

import asyncio

import pytest

from runtime import protocol as p
from runtime.client import AsyncClient, Client, ClientError, InvalidInputError, build_request, encode_request
from runtime.sampling_params import InvalidSamplingParams

NOWHERE = "tcp://127.0.0.1:9"  # nothing listens there; nothing is ever sent to it either

CASES = {
    "surrogate in prompt": (
        {"prompt": "ab\ud800"},
        "prompt is not UTF-8 text (surrogates not allowed at position 2), msgpack cannot carry it",
    ),
    "surrogate in a message": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\udfff"}]},
        "messages[1].content is not UTF-8 text (surrogates not allowed at position 0), msgpack cannot carry it",
    ),
    "surrogate in cache_salt": (
        {"prompt": "hi", "cache_salt": "\ud83d"},
        "cache_salt is not UTF-8 text (surrogates not allowed at position 0), msgpack cannot carry it",
    ),
    "input id 2**70": ({"input_ids": [1, 2**70]}, "input_ids[1] is an int outside msgpack's range [-2**63, 2**64 - 1]"),
    "input id -2**64": (
        {"input_ids": [-(2**64)]},
        "input_ids[0] is an int outside msgpack's range [-2**63, 2**64 - 1]",
    ),
    "message without content": (
        {"messages": [{"role": "user"}]},
        "messages[0] must be a ChatMessage or a dict with 'role' and 'content', got dict",
    ),
    "message as a string": (
        {"messages": ["hello"]},
        "messages[0] must be a ChatMessage or a dict with 'role' and 'content', got str",
    ),
    "prompt of an unsupported type": (
        {"prompt": object()},
        "prompt cannot be encoded: Encoding objects of type object is unsupported",
    ),
}


def frame_of(kwargs: dict, **params) -> bytes:
    return encode_request(
        build_request(
            "r",
            kwargs.get("prompt"),
            kwargs.get("messages"),
            kwargs.get("input_ids"),
            False,
            kwargs.get("cache_salt"),
            params,
        )
    )


@pytest.mark.parametrize("name", list(CASES))
def test_unsendable_input_raises_invalid_input_error_naming_the_field(name):
    kwargs, message = CASES[name]
    with pytest.raises(InvalidInputError) as info:
        frame_of(kwargs)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError) and isinstance(info.value, ClientError)


def test_unsendable_sampling_params_raise_invalid_sampling_params():
    with pytest.raises(InvalidSamplingParams, match=r"stop_token_ids\[0\] is an int of 71 bits"):
        frame_of({"prompt": "hi"}, stop_token_ids=[2**70])
    with pytest.raises(InvalidSamplingParams, match=r"stop\[0\] is not valid UTF-8 text"):
        frame_of({"prompt": "hi"}, stop=["\ud800"])


def test_a_sendable_request_encodes_to_what_the_server_decodes():
    frame = frame_of({"messages": [{"role": "user", "content": "hi"}]}, max_tokens=3)
    assert p.decode_client_frame(frame, 1 << 20) == p.GenerateRequest(
        rid="r", messages=[p.ChatMessage("user", "hi")], sampling_params=p.SamplingParams(max_tokens=3)
    )


def test_a_refused_call_leaves_no_request_in_the_client():
    with Client(NOWHERE, timeout=1.0) as c:
        for kwargs, _message in CASES.values():
            with pytest.raises(InvalidInputError):
                c.submit(**kwargs)
        with pytest.raises(InvalidSamplingParams):
            c.generate(prompt="hi", max_tokens=2**31)
        assert c._core.open_rids() == []

    async def refused() -> dict:
        async with AsyncClient(NOWHERE, timeout=1.0) as ac:
            with pytest.raises(InvalidInputError):
                await ac.generate(prompt="\ud800")
            with pytest.raises(InvalidInputError):
                async for _ in ac.stream(input_ids=[2**70]):
                    pass
            return {"open": ac._core.open_rids(), "waiting": dict(ac._arrived)}

    assert asyncio.run(refused()) == {"open": [], "waiting": {}}
