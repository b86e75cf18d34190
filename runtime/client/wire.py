"""Building what the client sends: build_request (keyword arguments -> GenerateRequest), build_tokenize and
build_detokenize (-> TokenizeRequest, DetokenizeRequest) and encode_request (a message -> its msgpack frame, or
InvalidInputError naming the field msgpack cannot carry)."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import msgspec

from runtime import protocol as p
from runtime.client.errors import InvalidInputError
from runtime.protocol.public import MAX_RID_CHARS
from runtime.sampling_params import SamplingParams


def build_request(
    rid: str,
    prompt: str | None,
    messages: list[dict[str, str]] | list[p.ChatMessage] | None,
    input_ids: list[int] | None,
    stream: bool,
    cache_salt: str | None,
    params: dict[str, Any],
) -> p.GenerateRequest:
    """A GenerateRequest from generate()/stream() keyword arguments; params are SamplingParams fields.

    Raises InvalidSamplingParams (from SamplingParams) for out-of-range values and InvalidInputError for a rid of
    more than MAX_RID_CHARS characters (the server would reject it) or a chat message that is neither a ChatMessage
    nor a dict with "role" and "content", before anything is sent.
    """
    if len(rid) > MAX_RID_CHARS:
        raise InvalidInputError(f"rid of {len(rid)} characters exceeds {MAX_RID_CHARS}")
    chat = None if messages is None else [_chat_message(i, m) for i, m in enumerate(messages)]
    return p.GenerateRequest(
        rid=rid,
        prompt=prompt,
        messages=chat,
        input_ids=input_ids,
        sampling_params=SamplingParams(**params),
        stream=stream,
        cache_salt=cache_salt,
    )


def build_tokenize(
    rid: str,
    prompt: str | None,
    messages: list[dict[str, str]] | list[p.ChatMessage] | None,
    add_special_tokens: bool,
) -> p.TokenizeRequest:
    """A TokenizeRequest from tokenize() arguments. Raises InvalidInputError for a chat message that is neither a
    ChatMessage nor a dict with "role" and "content" (the server checks the rest: exactly one of prompt and
    messages, the character limit)."""
    chat = None if messages is None else [_chat_message(i, m) for i, m in enumerate(messages)]
    return p.TokenizeRequest(rid=rid, prompt=prompt, messages=chat, add_special_tokens=add_special_tokens)


def build_detokenize(rid: str, token_ids: Iterable[int]) -> p.DetokenizeRequest:
    """A DetokenizeRequest from detokenize() arguments: token_ids as a list of Python ints (numpy integers too).
    Raises InvalidInputError when token_ids is not an iterable of integers (the server checks the vocabulary and the
    count)."""
    try:
        ids = [operator.index(t) for t in token_ids]
    except TypeError as exc:
        raise InvalidInputError(f"token_ids must be integers: {exc}") from None
    return p.DetokenizeRequest(rid, ids)


def _chat_message(i: int, m: Any) -> p.ChatMessage:
    if isinstance(m, p.ChatMessage):
        return m
    try:
        return p.ChatMessage(m["role"], m["content"])
    except (KeyError, TypeError, IndexError):
        raise InvalidInputError(
            f"messages[{i}] must be a ChatMessage or a dict with 'role' and 'content', got {type(m).__name__}"
        ) from None


_encoder = msgspec.msgpack.Encoder()
_ENCODE_ERRORS = (msgspec.EncodeError, OverflowError, TypeError, ValueError, RecursionError)  # ValueError: Unicode


def encode_request(msg: p.ClientMessage) -> bytes:
    """msg as the one msgpack frame to send. O(size of msg).

    Raises InvalidInputError naming the first field msgpack cannot carry (a lone surrogate in a prompt, message or
    cache_salt; an int outside [-2**63, 2**64 - 1] in input_ids; a value of an unsupported type), never a raw
    OverflowError / UnicodeEncodeError, and before anything is sent.
    """
    try:
        return _encoder.encode(msg)
    except _ENCODE_ERRORS:
        raise InvalidInputError(_unencodable(msg, "", 0)) from None


def _unencodable(value: Any, path: str, depth: int) -> str:
    """Why the innermost part of value on its first unencodable path cannot be encoded (only called on failure:
    each level encodes its parts once)."""
    if isinstance(value, msgspec.Struct):
        parts = [(f"{path}.{name}" if path else name, getattr(value, name)) for name in value.__struct_fields__]
    elif isinstance(value, (list, tuple)):
        parts = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    else:
        parts = []
    for part_path, part in parts if depth < 8 else []:
        try:
            _encoder.encode(part)
        except _ENCODE_ERRORS:
            return _unencodable(part, part_path, depth + 1)
    try:
        _encoder.encode(value)
    except UnicodeEncodeError as exc:
        return f"{path} is not UTF-8 text ({exc.reason} at position {exc.start}), msgpack cannot carry it"
    except OverflowError:
        return f"{path} is an int outside msgpack's range [-2**63, 2**64 - 1]"
    except _ENCODE_ERRORS as exc:
        return f"{path or 'the request'} cannot be encoded: {exc}"
    return f"{path or 'the request'} cannot be encoded"
