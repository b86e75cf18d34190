"""The constraint that makes a model call a tool (tool_choice "required" or a named function): an xgrammar
structural tag in the parser's own format, so the call is written exactly as the parser reads it and as the chat
template renders it in the next turn's history (its KV is then reused by the prefix cache).

The answer must be one call (parallel_tool_calls false, or a named function) or one or more calls joined by the
format's separator, and nothing else; each call's arguments object matches its function's `parameters` JSON schema.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from runtime.structured_outputs import StructuredOutputs
from runtime.text.tool_parsers.base import ToolParser

MAX_JSON_WHITESPACE = 1  # consecutive whitespace characters allowed inside the arguments: JSON needs none, and an
# unbounded run lets a small model spend its max_tokens on spaces before it closes the call


class FunctionSpec(NamedTuple):
    """A function a call may name: its name and its parameters' JSON schema (None: any object)."""

    name: str
    parameters: dict[str, Any] | None


def tool_call_constraint(parser: type[ToolParser], functions: list[FunctionSpec], parallel: bool) -> StructuredOutputs:
    """The StructuredOutputs (structural_tag, xgrammar's JSON form) that admits only calls of `functions` written
    in `parser`'s format (ToolParser.call_format): exactly one call when not parallel, else one or more.

    Args:
        parser: the server's tool parser class (runtime.text.tool_parsers.TOOL_PARSERS).
        functions: the functions a call may name (all tools for "required", one for a named choice); not empty.
    Raises:
        ValueError: functions is empty. Whether a schema compiles is checked where the grammar is compiled.
    """
    if not functions:
        raise ValueError("a tool call constraint needs at least one function")
    tags = []
    separator = ""
    for f in functions:
        fmt = parser.call_format(f.name)
        separator = fmt.separator
        schema = {"type": "object", **(f.parameters or {})}  # {} or no type allowed any JSON: arguments are objects
        content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
        tags.append({"type": "tag", "begin": fmt.begin, "content": content, "end": fmt.end})
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    return StructuredOutputs(structural_tag=json.dumps({"type": "structural_tag", "format": calls}))
