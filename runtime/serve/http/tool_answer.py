"""Tool calls in a chat answer, as the OpenAI API returns them, from what the model wrote (runtime.text.tool_parsers).

Non-streamed: message.tool_calls [{"id": "call_<24 hex>", "type": "function", "function": {"name", "arguments"}}],
content null when the whole answer is calls, finish_reason "tool_calls" when there is a call and the model ended
its answer (an answer max_tokens cut keeps "length", as OpenAI's: a call cut there stays content). Streamed: the same
parser, fed each chunk's text, releases content deltas and whole calls; each call is sent as OpenAI streams one, a
delta with its index, id, type, name and empty arguments, then a delta with its arguments. A call is sent once its
text parsed whole (nothing sent is retracted), so its arguments come as one fragment. Both face the same parser on
the same text, so the streamed answer folds into the non-streamed one.
"""

from __future__ import annotations

import uuid
from typing import Any

from runtime.serve.http.tool_request import ToolSetup
from runtime.text.tool_parsers import Parsed, ToolCall, parse


def call_id() -> str:
    """A fresh tool call id: "call_" and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def call_body(call: ToolCall, id: str) -> dict[str, Any]:
    """One entry of message.tool_calls."""
    return {"id": id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_message(text: str, finish_reason: str | None, setup: ToolSetup | None) -> tuple[dict[str, Any], str | None]:
    """The message of a non-streamed choice whose text is `text`, and its finish_reason ("tool_calls" when the
    answer holds a call and finish_reason is "stop"; else finish_reason). setup None: no parsing, the text is the
    content."""
    if setup is None:
        return {"role": "assistant", "content": text}, finish_reason
    parsed = parse(setup.parser(), text)
    calls = parsed.calls if setup.parallel else parsed.calls[:1]
    if not calls:
        return {"role": "assistant", "content": parsed.content}, finish_reason
    message = {
        "role": "assistant",
        "content": parsed.content or None,
        "tool_calls": [call_body(c, call_id()) for c in calls],
    }
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolCallStream:
    """One streamed choice's tool calls: deltas(text, final) for each backend chunk's text."""

    def __init__(self, setup: ToolSetup) -> None:
        self.parser = setup.parser()
        self.parallel = setup.parallel
        self.num_calls = 0

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The deltas (dicts for choices[].delta, content and tool_calls) that text releases, in order; final: the
        chunk ends the choice (held text is released). [] when nothing is certain yet."""
        parsed = self.parser.feed(text)
        if final:
            last = self.parser.finish()
            parsed = Parsed(parsed.content + last.content, parsed.calls + last.calls)
        out: list[dict[str, Any]] = []
        if parsed.content:
            out.append({"content": parsed.content})
        for call in parsed.calls:
            if self.num_calls and not self.parallel:
                break
            head = {"index": self.num_calls, **call_body(ToolCall(call.name, ""), call_id())}
            out.append({"tool_calls": [head]})
            out.append({"tool_calls": [{"index": self.num_calls, "function": {"arguments": call.arguments}}]})
            self.num_calls += 1
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's finish_reason: "tool_calls" once a call was sent and the backend's is "stop", else the
        backend's ("length": max_tokens cut the answer)."""
        return "tool_calls" if reason == "stop" and self.num_calls else reason
