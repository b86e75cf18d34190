"""The tool-call parser interface: what a model wrote (text) -> content and tool calls, fed incrementally so a
stream and a whole answer give the same result.

A parser is fed the completion's text in pieces (feed) and told when it ends (finish); each call returns the
content released so far and the calls completed so far (Parsed). Parsing the whole text at once is feeding it in one
piece (parse), so streamed and non-streamed answers agree by construction: the parser's decisions depend only on the
text, never on where the pieces were cut.

Rules every parser keeps (issue 22): a call is released only once its text parsed whole, so nothing sent is ever
retracted; text that looks like a call but does not parse is released as content, never an error; content is never
a call's text.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, NamedTuple


class ToolCall(NamedTuple):
    """One parsed call: name (the function's), arguments (a JSON object, as JSON text: json.dumps of the parsed
    object with ensure_ascii=False, so the same arguments always read the same)."""

    name: str
    arguments: str


class Parsed(NamedTuple):
    """What one feed / finish released: content (text to send as content, may be "") and calls, in order."""

    content: str
    calls: list[ToolCall]


class CallFormat(NamedTuple):
    """How a parser's format writes one call of function `name` around its arguments' JSON object, for the grammar
    that enforces a call (runtime.text.tool_parsers.grammar): begin + <arguments object> + end, calls joined by
    separator."""

    begin: str
    end: str
    separator: str


class ToolParser(ABC):
    """An incremental parser of one completion's text. feed(text) with each new piece of text, then finish() once;
    the concatenation of every Parsed.content is the answer's content, every Parsed.calls its calls."""

    name: str = ""

    @abstractmethod
    def feed(self, text: str) -> Parsed:
        """Takes the next piece of the completion's text; returns what is now certain. O(len(text)) amortized."""

    @abstractmethod
    def finish(self) -> Parsed:
        """The completion ended: releases everything held back (an unterminated call that parses is a call, else
        content). Call once, after the last feed."""

    @staticmethod
    @abstractmethod
    def call_format(name: str) -> CallFormat:
        """The text around function `name`'s arguments object in this parser's format (see CallFormat)."""


def parse(parser: ToolParser, text: str) -> Parsed:
    """The whole text parsed by a fresh parser: content and calls (the non-streamed answer)."""
    first = parser.feed(text)
    last = parser.finish()
    return Parsed(first.content + last.content, first.calls + last.calls)


def call_from_json(obj: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A ToolCall from a decoded call object {"name": str, <argument key>: object}, else None. The arguments may be
    an object or JSON text of an object (some models write them as a string); a missing argument key means {}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of tag (text that may yet become the tag,
    so it is held back). O(len(tag)^2) at most, tags are short."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
