"""Tool-call parsers (one per file) and their registry: the text a model wrote -> content and tool calls, for the
HTTP server's `--tool-call-parser` (vLLM's names)."""

from __future__ import annotations

from runtime.text.tool_parsers.base import CallFormat, Parsed, ToolCall, ToolParser, parse
from runtime.text.tool_parsers.hermes import HermesToolParser
from runtime.text.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def tool_parser_class(name: str) -> type[ToolParser]:
    """The parser class registered as name. Raises KeyError naming the known parsers."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool call parser {name!r}; known: {sorted(TOOL_PARSERS)}") from None


__all__ = ["TOOL_PARSERS", "CallFormat", "Parsed", "ToolCall", "ToolParser", "parse", "tool_parser_class"]
