"""The request and result types of runtime.client: build_request (keyword arguments -> GenerateRequest),
encode_request (a message -> its frame, or InvalidInputError), Completion and its Choices, and the collector that folds
a request's StreamChunks into a Completion."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from runtime import protocol as p
from runtime.client_errors import InvalidInputError
from runtime.protocol.public import MAX_RID_CHARS
from runtime.sampling_params import SamplingParams


class Choice(msgspec.Struct, kw_only=True):
    """One completion: text, token_ids, finish_reason, logprobs (aligned with token_ids when asked for); score: a
    beam search completion's length-penalised cumulative logprob (use_beam_search: choices come best first)."""

    index: int
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[p.TokenLogprobs | None] | None = None
    usage: p.Usage | None = None
    score: float | None = None


class Completion(msgspec.Struct, kw_only=True):
    """The result of generate(): choices (n of them, by index); text / token_ids / finish_reason are choice 0's.

    usage: prompt_tokens and cached_tokens of the prompt, completion_tokens summed over the choices.
    ttft_s: seconds from sending the request to the first chunk with tokens.
    """

    rid: str
    choices: list[Choice]
    usage: p.Usage
    ttft_s: float

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason


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
    return p.GenerateRequest(rid=rid, prompt=prompt, messages=chat, input_ids=input_ids,
                             sampling_params=SamplingParams(**params), stream=stream, cache_salt=cache_salt)


def _chat_message(i: int, m: Any) -> p.ChatMessage:
    if isinstance(m, p.ChatMessage):
        return m
    try:
        return p.ChatMessage(m["role"], m["content"])
    except (KeyError, TypeError, IndexError):
        raise InvalidInputError(f"messages[{i}] must be a ChatMessage or a dict with 'role' and 'content', got "
                                f"{type(m).__name__}") from None


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


class _Collector:
    """Folds the StreamChunks of one request into a Completion."""

    def __init__(self, rid: str, n: int, start: float) -> None:
        self.rid, self.start = rid, start
        self.choices = [Choice(index=i) for i in range(n)]
        self.ttft_s = -1.0

    def add(self, chunk: p.StreamChunk) -> bool:
        """Folds chunk in; True when every choice has finished."""
        if self.ttft_s < 0 and chunk.token_ids:
            self.ttft_s = time.perf_counter() - self.start
        c = self.choices[chunk.index]
        c.text += chunk.text
        c.token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:  # appended: O(1) per token over many chunks
            if c.logprobs is None:
                c.logprobs = []
            c.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            c.finish_reason, c.usage, c.score = chunk.finish_reason, chunk.usage, chunk.score
        return all(c.finish_reason is not None for c in self.choices)

    def result(self) -> Completion:
        usages = [c.usage for c in self.choices if c.usage is not None]
        first = usages[0] if usages else p.Usage(0, 0, 0)
        usage = p.Usage(first.prompt_tokens, first.cached_tokens, sum(u.completion_tokens for u in usages),
                        first.queue_time_s, first.host_cached_tokens)
        return Completion(rid=self.rid, choices=self.choices, usage=usage, ttft_s=max(self.ttft_s, 0.0))
