"""The tool fields of a chat request (OpenAI's tools, tool_choice, parallel_tool_calls, and the assistant tool_calls
of the history), checked once and mapped onto what the backend and the answer need.

    tools -> ChatOptions.tools (rendered by the chat template: runtime.text.chat_templates picks one that can).
    tool_choice: "auto" (the default with tools): the answer is parsed by the server's --tool-call-parser;
        "none" (the default without tools): the tools are still rendered (as vLLM does) and nothing is parsed;
        "required" / {"type": "function", "function": {"name": N}}: also parsed, and enforced by a grammar
        (runtime.text.tool_parsers.grammar): one or more calls of any tool (one when parallel_tool_calls is
        false) / exactly one call of N, whose arguments match the function's parameters schema.
    parallel_tool_calls (default true): false keeps the first call of an answer only.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from runtime import protocol as p
from runtime.serve.http.errors import OpenAIError, bad_request
from runtime.structured_outputs import StructuredOutputs
from runtime.text.tool_parsers import ToolParser
from runtime.text.tool_parsers.grammar import FunctionSpec, tool_call_constraint

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule for a function name (plus ".", as vLLM)
MAX_TOOLS = 128  # OpenAI's limit of tools in one request


class ToolSetup(NamedTuple):
    """How a chat answer's tool calls are read: parser (the class, a fresh instance per choice), parallel (more
    than one call per answer kept), constraint (the grammar of "required" / a named function; None for "auto")."""

    parser: type[ToolParser]
    parallel: bool
    constraint: StructuredOutputs | None


class ChatTools(NamedTuple):
    """A request's tools (None: none given) and how its answer is parsed (None: it is not, tool_choice "none")."""

    tools: list[dict[str, Any]] | None
    setup: ToolSetup | None


def chat_tools(tools: Any, tool_choice: Any, parallel: bool | None, parser: type[ToolParser]) -> ChatTools:
    """The checked tool fields of a chat request. Raises OpenAIError (400) naming the field: a tool that is not
    {"type": "function", "function": {"name", "description"?, "parameters"?: object schema, "strict"?}} (a
    parameters schema whose type is not "object", as OpenAI refuses it), a bad or repeated
    name, more than MAX_TOOLS tools, a tool_choice that is none of the four forms or names no tool, a tool_choice
    other than "none" without tools. O(tools)."""
    specs = _functions(tools) if tools else []
    if tool_choice is None:
        tool_choice = "auto" if specs else "none"
    if tool_choice == "none":
        return ChatTools(tools or None, None)
    if not specs:
        raise bad_request("tool_choice needs tools", "tool_choice")
    parallel = True if parallel is None else parallel
    if tool_choice == "auto":
        return ChatTools(tools, ToolSetup(parser, parallel, None))
    if tool_choice == "required":
        return ChatTools(tools, ToolSetup(parser, parallel, tool_call_constraint(parser, specs, parallel)))
    name = _named_choice(tool_choice)
    named = [f for f in specs if f.name == name]
    if not named:
        raise bad_request(f"tool_choice names {name[:64]!r}, which is not among the tools", "tool_choice")
    return ChatTools(tools, ToolSetup(parser, False, tool_call_constraint(parser, named, False)))


def _named_choice(choice: Any) -> str:
    """The function name of a {"type": "function", "function": {"name": N}} choice."""
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return name


def _functions(tools: Any) -> list[FunctionSpec]:
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of function tools", "tools", "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools has {len(tools)} tools, at most {MAX_TOOLS} are allowed", "tools")
    specs: list[FunctionSpec] = []
    for i, tool in enumerate(tools):
        spec = _function(f"tools[{i}]", tool)
        if any(s.name == spec.name for s in specs):
            raise bad_request(f"tools[{i}].function.name {spec.name!r} is repeated", f"tools[{i}].function.name")
        specs.append(spec)
    return specs


def _function(at: str, tool: Any) -> FunctionSpec:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request(f'{at}.type must be "function"', f"{at}.type")
    f = tool.get("function")
    if not isinstance(f, dict):
        raise bad_request(f"{at}.function must be an object", f"{at}.function", "invalid_type")
    name = f.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise bad_request(f"{at}.function.name must match {FUNCTION_NAME.pattern}", f"{at}.function.name")
    params = f.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{at}.function.parameters must be a JSON schema object", f"{at}.function.parameters")
    if params is not None and params.get("type", "object") != "object":  # a call's arguments are an object
        raise bad_request(
            f'{at}.function.parameters must be a schema of type "object", got type {str(params["type"])[:40]!r}',
            f"{at}.function.parameters",
        )
    if f.get("description") is not None and not isinstance(f["description"], str):
        raise bad_request(f"{at}.function.description must be a string", f"{at}.function.description", "invalid_type")
    return FunctionSpec(name, params)


def history_tool_calls(at: str, calls: Any) -> list[p.ChatToolCall]:
    """An assistant message's tool_calls ([{"id", "type": "function", "function": {"name", "arguments"}}]) as the
    backend takes them; arguments stay the JSON text the client sent. Raises OpenAIError (400) naming the field."""
    if not isinstance(calls, list):
        raise bad_request(f"{at} must be a list", at, "invalid_type")
    out = []
    for j, call in enumerate(calls):
        where = f"{at}[{j}]"
        f = call.get("function") if isinstance(call, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
            raise _bad_call(where)
        call_id = call.get("id", "")
        if not isinstance(call_id, str) or call.get("type", "function") != "function":
            raise _bad_call(where)
        out.append(p.ChatToolCall(call_id, f["name"], f["arguments"]))
    return out


def _bad_call(where: str) -> OpenAIError:
    return bad_request(
        f'{where} must be {{"id": str, "type": "function", "function": {{"name": str, "arguments": str}}}}',
        where,
        "invalid_type",
    )
