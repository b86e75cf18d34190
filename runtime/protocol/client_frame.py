"""The server's one strict, typed reader of a public frame: decode_client_frame turns any byte string into a
ClientMessage or the ErrorResponse to send back (runtime.protocol.public defines the messages and error codes).

The tokenizer process and the router call it on every client frame: a ZeroMQ client can send anything, so this is
where what crosses the public socket is validated (types, unknown fields, rid length, SamplingParams' ranges).
"""

from __future__ import annotations

from typing import Any

import msgspec

from runtime.protocol.public import (
    CLIENT_TAGS,
    ERR_INVALID,
    ERR_MALFORMED,
    ERR_TOO_LARGE,
    ERR_UNKNOWN_MESSAGE,
    MAX_RID_CHARS,
    ClientMessage,
    ErrorResponse,
    GenerateRequest,
)
from runtime.sampling_params import InvalidSamplingParams, SamplingParams


class _Envelope(msgspec.Struct):
    """The two fields every client message has, read without the rest: msgspec skips the other fields unread (so
    this is cheap even for a frame over max_message_bytes). Raw: a field of the wrong type spoils only itself."""

    rid: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    type: msgspec.Raw = msgspec.Raw(b"\xc0")


class _UncheckedSamplingParams(SamplingParams, kw_only=True, forbid_unknown_fields=True):
    """SamplingParams' wire shape (the same fields and types) without its range check."""

    def __post_init__(self) -> None:
        pass


class _UncheckedGenerate(GenerateRequest, tag="generate", kw_only=True, forbid_unknown_fields=True):
    """GenerateRequest's wire shape with unchecked SamplingParams: tells a range error from a type error."""

    sampling_params: _UncheckedSamplingParams = msgspec.field(default_factory=_UncheckedSamplingParams)


_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_keys_decoder = msgspec.msgpack.Decoder(dict[Any, msgspec.Raw])  # a map whose keys are not all strings
_str_decoder = msgspec.msgpack.Decoder(str)
_unchecked_generate_decoder = msgspec.msgpack.Decoder(_UncheckedGenerate)


def decode_client_frame(frame: bytes, max_message_bytes: int) -> ClientMessage | ErrorResponse:
    """Decode one public frame strictly; a frame that cannot be served becomes the ErrorResponse to send back.

    Total: returns for every byte string (never raises, never unpickles). The frame is msgpack decoded into the
    ClientMessage union (typed, unknown fields rejected, SamplingParams validated). A rejected frame gets:
    ERR_TOO_LARGE (over max_message_bytes; nothing but its rid is read), ERR_UNKNOWN_MESSAGE (a map whose "type" is
    not one of CLIENT_TAGS), ERR_INVALID (a GenerateRequest of the right types whose SamplingParams are out of range:
    the message names the field) or ERR_MALFORMED (not msgpack, not a map, wrong field types or shape, unknown
    fields). A string "rid" of more than MAX_RID_CHARS characters comes first: whatever else is wrong with the
    frame (its size included), it gets ERR_MALFORMED "rid of N characters exceeds 256" with rid "", so no reply
    echoes an oversized rid. Otherwise the rid of a rejected frame is recovered whenever the frame is a msgpack map
    with a string "rid", so a client with many requests in flight can route the error; else it is "". Exceptions,
    none of which a client library produces: over max_message_bytes the other keys must be strings too (they are
    skipped, not decoded); a map with a map or ext key (unhashable) or nested past msgspec's depth limit cannot be
    read at all.
    Cost: O(len(frame)) in msgspec's C code; a rejected frame is read at most four times.
    """
    if len(frame) > max_message_bytes:
        return _error(
            _rid_of(frame, keys_fallback=False),
            ERR_TOO_LARGE,
            f"message of {len(frame)} bytes exceeds {max_message_bytes} bytes",
        )
    try:
        return _client_decoder.decode(frame)
    except Exception as exc:  # DecodeError, ValidationError, RecursionError (deep nesting), MemoryError: all rejected
        return _rejection(frame, exc)


def _rejection(frame: bytes, error: Exception) -> ErrorResponse:
    """The ErrorResponse for a frame the typed decode rejected with error. Never raises."""
    envelope = _envelope(frame)
    if envelope is None:
        return _error(
            _rid_of(frame, keys_fallback=True),
            ERR_MALFORMED,
            f"a message is a msgpack map with string keys: {_short(error)}",
        )
    rid = _as_str(envelope.rid) or ""
    if len(rid) > MAX_RID_CHARS:
        return _rid_error(rid)
    tag = _as_str(envelope.type)
    if tag not in CLIENT_TAGS:
        shown = repr(tag) if tag is not None else "missing or not a string"
        return ErrorResponse(
            rid, ERR_UNKNOWN_MESSAGE, f"unknown message type {_clip(shown)}; known: {sorted(CLIENT_TAGS)}"
        )
    if tag == "generate":
        return _generate_rejection(frame, rid, error)
    return ErrorResponse(rid, ERR_MALFORMED, _short(error))


def _error(rid: str, code: str, message: str) -> ErrorResponse:
    """ErrorResponse(rid, code, message), or the oversized-rid error when rid is over MAX_RID_CHARS."""
    return _rid_error(rid) if len(rid) > MAX_RID_CHARS else ErrorResponse(rid, code, message)


def _rid_error(rid: str) -> ErrorResponse:
    """The answer to a frame whose rid is over MAX_RID_CHARS: rid "" (an oversized rid is never echoed)."""
    return ErrorResponse("", ERR_MALFORMED, f"rid of {len(rid)} characters exceeds {MAX_RID_CHARS}")


def _generate_rejection(frame: bytes, rid: str, error: Exception) -> ErrorResponse:
    """A rejected generate frame: ERR_INVALID when every field has the right type and SamplingParams are out of
    range (the message names the field), else ERR_MALFORMED naming the first type or shape error."""
    try:
        shape = _unchecked_generate_decoder.decode(frame)
    except Exception as exc:  # a type or shape error, whatever the ranges
        return ErrorResponse(rid, ERR_MALFORMED, _short(exc))
    try:
        SamplingParams(**msgspec.structs.asdict(shape.sampling_params))
    except InvalidSamplingParams as exc:
        return ErrorResponse(rid, ERR_INVALID, f"invalid sampling_params: {exc}")
    return ErrorResponse(rid, ERR_MALFORMED, _short(error))


def _envelope(frame: bytes) -> _Envelope | None:
    try:
        return _envelope_decoder.decode(frame)
    except Exception:  # not msgpack, not a map, a non-string key, too deep
        return None


def _rid_of(frame: bytes, keys_fallback: bool) -> str:
    """The string "rid" of a msgpack map frame, else "". keys_fallback: also read a map with non-string keys (its
    keys are decoded: not for a frame over the size limit)."""
    envelope = _envelope(frame)
    if envelope is not None:
        return _as_str(envelope.rid) or ""
    if not keys_fallback:
        return ""
    try:
        fields = _keys_decoder.decode(frame)
        raw = fields.get("rid")
    except Exception:  # not a map, unhashable keys, too deep
        return ""
    return (_as_str(raw) if raw is not None else None) or ""


def _as_str(raw: msgspec.Raw) -> str | None:
    try:
        return _str_decoder.decode(raw)
    except Exception:
        return None


def _clip(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(error: Exception) -> str:
    """An exception as a bounded one-line message for an ErrorResponse."""
    return _clip(str(error) or type(error).__name__, 500)


def frame_rid(frame: bytes) -> str:
    """The string "rid" of a msgpack map frame, else "" (also for a rid over MAX_RID_CHARS: never echo one). Reads
    nothing but the rid; never raises. The tokenizer loop's last-resort answer uses it."""
    rid = _rid_of(frame, keys_fallback=False)
    if len(rid) > MAX_RID_CHARS:
        return ""
    return rid
