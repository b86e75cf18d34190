"""The Hermes format (NousResearch Hermes 2 Pro, Qwen2.5, and the ChatML tool template this repository ships):
each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, free text around the calls."""

from __future__ import annotations

import json

from runtime.text.tool_parsers.base import CallFormat, ToolCall, call_from_json
from runtime.text.tool_parsers.tagged import TaggedToolParser


class HermesToolParser(TaggedToolParser):
    """Calls between <tool_call> and </tool_call>, one JSON object each ("arguments", or "parameters", an object)."""

    name = "hermes"
    begin_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse_body(self, body: str) -> ToolCall | None:
        """The JSON object between the tags (surrounding whitespace allowed), else None."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        return call_from_json(obj)

    @staticmethod
    def call_format(name: str) -> CallFormat:
        """<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>, calls on separate lines: how the shipped
        template renders a call in the history, so a generated call is cached as the next turn renders it."""
        head = json.dumps(name, ensure_ascii=False)
        return CallFormat(f'<tool_call>\n{{"name": {head}, "arguments": ', "}\n</tool_call>", "\n")
