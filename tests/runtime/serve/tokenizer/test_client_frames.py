"""decode_client_frame: each kind of bad frame gets its exact code, rid and message; nothing it is given makes it raise
(the hypothesis fuzz of every msgpack shape is tests/runtime/test_frame_fuzz.py)."""

from __future__ import annotations

import msgspec
import pytest

from runtime import protocol as p

KNOWN = "known: ['abort', 'detokenize', 'generate', 'health', 'kv_snapshot_request', 'stats', 'tokenize']"


def enc(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


def gen(**fields) -> bytes:
    return enc({"type": "generate", "rid": "r", **fields})


CASES = {
    # a "type" that is not a string: the untyped fallback raised TypeError (unhashable) out of the decoder
    "type is a list": (
        enc({"type": [1], "rid": "r"}),
        "r",
        p.ERR_UNKNOWN_MESSAGE,
        f"unknown message type missing or not a string; {KNOWN}",
    ),
    "type is a map": (
        enc({"type": {"a": 1}}),
        "",
        p.ERR_UNKNOWN_MESSAGE,
        f"unknown message type missing or not a string; {KNOWN}",
    ),
    "no type": (
        enc({"rid": "r"}),
        "r",
        p.ERR_UNKNOWN_MESSAGE,
        f"unknown message type missing or not a string; {KNOWN}",
    ),
    # a range error next to a type error is a type error (the old string match called it invalid_request)
    "range and type error": (
        gen(sampling_params={"max_tokens": 0}, prompt=5),
        "r",
        p.ERR_MALFORMED,
        "Expected `str | null`, got `int` - at `$.prompt`",
    ),
    # an unknown sampling field has no "Expected" in its message: the old string match called it invalid_request
    "unknown sampling field": (
        gen(prompt="x", sampling_params={"colour": 1}),
        "r",
        p.ERR_MALFORMED,
        "Object contains unknown field `colour` - at `$.sampling_params`",
    ),
    "out of range": (
        gen(prompt="x", sampling_params={"max_tokens": 0}),
        "r",
        p.ERR_INVALID,
        "invalid sampling_params: max_tokens must be in [1, 2147483647], got 0",
    ),
    "uint64 stop token id": (
        gen(prompt="x", sampling_params={"stop_token_ids": [2**64 - 1]}),
        "r",
        p.ERR_INVALID,
        "invalid sampling_params: stop_token_ids must be ints in [0, 2147483647], "
        "stop_token_ids[0] is 18446744073709551615",
    ),
    "non-string key": (
        enc({1: 2, "rid": "x"}),
        "x",
        p.ERR_MALFORMED,
        "a message is a msgpack map with string keys: Expected `str`, got `int` - at `key` in `$`",
    ),
    "unhashable key": (
        b"\x82\x81\x00\x01\x01\xa3rid\xa1y",
        "",
        p.ERR_MALFORMED,
        "a message is a msgpack map with string keys: Expected `str`, got `object` - at `key` in `$`",
    ),
    "not a map": (
        enc([1, 2]),
        "",
        p.ERR_MALFORMED,
        "a message is a msgpack map with string keys: Expected `object`, got `array`",
    ),
    "detokenize without token_ids": (
        enc({"type": "detokenize", "rid": "r"}),
        "r",
        p.ERR_MALFORMED,
        "Object missing required field `token_ids`",
    ),
    "detokenize ids of text": (
        enc({"type": "detokenize", "rid": "r", "token_ids": "abc"}),
        "r",
        p.ERR_MALFORMED,
        "Expected `array`, got `str` - at `$.token_ids`",
    ),
    "detokenize float id": (
        enc({"type": "detokenize", "rid": "r", "token_ids": [1, 2.5]}),
        "r",
        p.ERR_MALFORMED,
        "Expected `int`, got `float` - at `$.token_ids[1]`",
    ),
    "tokenize int prompt": (
        enc({"type": "tokenize", "rid": "r", "prompt": 5}),
        "r",
        p.ERR_MALFORMED,
        "Expected `str | null`, got `int` - at `$.prompt`",
    ),
    "tokenize unknown field": (
        enc({"type": "tokenize", "rid": "r", "prompt": "x", "colour": 1}),
        "r",
        p.ERR_MALFORMED,
        "Object contains unknown field `colour`",
    ),
    "tokenize message without content": (
        enc({"type": "tokenize", "rid": "r", "messages": [{"role": "user"}]}),
        "r",
        p.ERR_MALFORMED,
        "Object missing required field `content` - at `$.messages[0]`",
    ),
    "tokenize add_special_tokens of text": (
        enc({"type": "tokenize", "rid": "r", "prompt": "x", "add_special_tokens": "yes"}),
        "r",
        p.ERR_MALFORMED,
        "Expected `bool`, got `str` - at `$.add_special_tokens`",
    ),
    "tokenize rid over the limit": (
        enc({"type": "tokenize", "rid": "x" * 300, "prompt": 5}),
        "",
        p.ERR_MALFORMED,
        "rid of 300 characters exceeds 256",
    ),
    "empty": (b"", "", p.ERR_MALFORMED, "a message is a msgpack map with string keys: Input data was truncated"),
    "ext": (
        b"\xd4\x01\x00",
        "",
        p.ERR_MALFORMED,
        "a message is a msgpack map with string keys: Expected `object`, got `ext`",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_bad_frame_gets_its_code_rid_and_message(name):
    frame, rid, code, message = CASES[name]
    assert p.decode_client_frame(frame, 1 << 20) == p.ErrorResponse(rid, code, message)


def test_a_frame_over_the_limit_keeps_its_rid():
    frame = gen(prompt="x" * 2000)
    assert p.decode_client_frame(frame, 1000) == p.ErrorResponse(
        "r", p.ERR_TOO_LARGE, f"message of {len(frame)} bytes exceeds 1000 bytes"
    )
    huge = enc({"type": "generate", "prompt": "y" * (8 << 20), "rid": "last"})  # rid after 8 MB: still found
    assert p.decode_client_frame(huge, 1000).rid == "last"
    assert p.decode_client_frame(enc({1: "x" * 2000, "rid": "r"}), 1000).rid == ""  # keys not decoded over the limit


def test_the_rid_is_recovered_from_any_map_with_a_string_rid():
    frames = [
        enc({"rid": "a", "type": "generate", "prompt": 1}),
        enc({"rid": "a", "type": 7}),
        enc({"rid": "a", "type": ["x"]}),
        enc({"rid": "a", 3.5: None}),
        enc({"type": "stats", "rid": "a", "x": 1}),
    ]
    assert [p.decode_client_frame(f, 1 << 20).rid for f in frames] == ["a"] * 5


def test_tokenize_and_detokenize_requests_decode_typed():
    """Well-typed tokenize / detokenize frames decode to their messages; range and vocabulary are the server's to
    check (TextRequests), not the reader's."""
    frame = enc({"type": "tokenize", "rid": "t", "messages": [{"role": "user", "content": "hi"}]})
    assert p.decode_client_frame(frame, 1 << 20) == p.TokenizeRequest(
        rid="t", messages=[p.ChatMessage("user", "hi")], add_special_tokens=True
    )
    frame = enc({"type": "tokenize", "rid": "t", "prompt": "", "add_special_tokens": False})
    assert p.decode_client_frame(frame, 1 << 20) == p.TokenizeRequest(rid="t", prompt="", add_special_tokens=False)
    frame = enc({"type": "detokenize", "rid": "d", "token_ids": [2**64 - 1, -1, 0]})
    assert p.decode_client_frame(frame, 1 << 20) == p.DetokenizeRequest("d", [2**64 - 1, -1, 0])
    huge = enc({"type": "detokenize", "rid": "big", "token_ids": [1] * 2000})
    assert p.decode_client_frame(huge, 1000) == p.ErrorResponse(
        "big", p.ERR_TOO_LARGE, f"message of {len(huge)} bytes exceeds 1000 bytes"
    )


def test_tiny_temperature_decodes_and_is_greedy():
    msg = p.decode_client_frame(gen(prompt="x", sampling_params={"temperature": 1e-30}), 1 << 20)
    assert isinstance(msg, p.GenerateRequest) and msg.sampling_params.greedy
