"""Llama 3.x's JSON tool calls (the format of Meta's llama3.1/3.2 templates with JSON tool calling): the whole answer
is one or more `{"name": ..., "parameters": {...}}` objects separated by ";", optionally after <|python_tag|>."""

from __future__ import annotations

import json

from runtime.text.tool_parsers.base import CallFormat, Parsed, ToolCall, ToolParser, call_from_json, held_prefix

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """An answer whose text (leading whitespace and <|python_tag|> aside) starts with "{" is held to the end and
    parsed as calls separated by ";" ("parameters" or "arguments"); if any part fails to parse, the whole answer is
    content. Any other answer is content, released as it comes."""

    name = "llama3_json"

    def __init__(self) -> None:
        self._buf = ""
        self._mode: str | None = None  # None: undecided; "content"; "calls" (held to the end)

    def feed(self, text: str) -> Parsed:
        if self._mode == "content":
            return Parsed(text, [])
        self._buf += text
        head = self._buf.lstrip()
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG) :].lstrip()
        elif held_prefix(head, PYTHON_TAG) == len(head):
            return Parsed("", [])  # only whitespace, or a beginning of <|python_tag|>: undecided
        if not head:
            return Parsed("", [])
        if head.startswith("{"):
            self._mode = "calls"
            return Parsed("", [])
        self._mode = "content"
        out = self._buf
        self._buf = ""
        return Parsed(out, [])

    def finish(self) -> Parsed:
        text = self._buf
        self._buf = ""
        if self._mode == "content" or not text:
            return Parsed(text, [])
        calls = _calls(text)
        if calls is None:
            return Parsed(text, [])
        return Parsed("", calls)

    @staticmethod
    def call_format(name: str) -> CallFormat:
        """{"name": NAME, "parameters": ARGS}, calls separated by "; "."""
        head = json.dumps(name, ensure_ascii=False)
        return CallFormat(f'{{"name": {head}, "parameters": ', "}", "; ")


def _calls(text: str) -> list[ToolCall] | None:
    """The calls of a whole answer, or None when any part is not a call. O(len(text))."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        call = call_from_json(obj)
        if call is None:
            return None
        calls.append(call)
        pos = _skip_separator(body, end)
        if pos < 0:
            return None
    return calls or None


def _skip_separator(body: str, pos: int) -> int:
    """The position after the whitespace and ";" that follow a call (len(body) at the end), -1 if something else
    follows."""
    rest = body[pos:].lstrip()
    if not rest:
        return len(body)
    if not rest.startswith(";"):
        return -1
    return len(body) - len(rest[1:].lstrip())
