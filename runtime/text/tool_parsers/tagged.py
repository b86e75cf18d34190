"""TaggedToolParser: calls written between a begin and an end tag (Hermes' <tool_call>...</tool_call>), free text
around them. One state machine for the stream and the whole answer (runtime.text.tool_parsers.base)."""

from __future__ import annotations

from abc import abstractmethod

from runtime.text.tool_parsers.base import Parsed, ToolCall, ToolParser, held_prefix


class TaggedToolParser(ToolParser):
    """Text outside begin_tag ... end_tag is content; each tagged body that parse_body accepts is a call, one it
    rejects is content (its tags included). The whitespace next to a parsed call (before and after it) is dropped
    from the content, so "Let me look.\\n<tool_call>...</tool_call>\\n" has content "Let me look."; an answer
    without calls keeps its text unchanged. A call left open at the end (the model stopped before end_tag) is a call
    if its body parses.

    Held back while streaming: a suffix that may start begin_tag, a call until its end tag, and trailing whitespace
    (which a following call would drop). State is O(held text)."""

    begin_tag: str = ""
    end_tag: str = ""

    def __init__(self) -> None:
        self._buf = ""  # text not yet released
        self._in_call = False  # _buf is a call's body (begin_tag consumed)
        self._space = ""  # whitespace held after released content
        self._after_call = False  # the last thing released was a call: drop the whitespace that follows

    @abstractmethod
    def parse_body(self, body: str) -> ToolCall | None:
        """The call written between the tags, or None when the body is not a call."""

    def feed(self, text: str) -> Parsed:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> Parsed:
        out = self._advance(final=True)
        if self._in_call:
            call = self.parse_body(self._buf)
            if call is not None:
                out.calls.append(call)
                self._space = ""
            else:
                out = Parsed(out.content + self._space + self.begin_tag + self._buf, out.calls)
                self._space = ""
        else:
            out = Parsed(out.content + self._content(self._buf, final=True), out.calls)
        self._buf = ""
        return out

    def _advance(self, final: bool) -> Parsed:
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._in_call:
                i = self._buf.find(self.begin_tag)
                if i < 0:
                    keep = 0 if final else held_prefix(self._buf, self.begin_tag)
                    if not final:
                        content.append(self._content(self._buf[: len(self._buf) - keep], final=False))
                        self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._content(self._buf[:i], final=False))
                self._buf = self._buf[i + len(self.begin_tag) :]
                self._in_call = True
                continue
            j = self._buf.find(self.end_tag)
            if j < 0:
                break
            body = self._buf[:j]
            self._buf = self._buf[j + len(self.end_tag) :]
            self._in_call = False
            call = self.parse_body(body)
            if call is not None:
                calls.append(call)
                self._space = ""
                self._after_call = True
            else:
                content.append(self._space + self.begin_tag + body + self.end_tag)
                self._space = ""
                self._after_call = False
        return Parsed("".join(content), calls)

    def _content(self, text: str, final: bool) -> str:
        """text released as content: leading whitespace dropped right after a call, trailing whitespace held (a
        call may follow) unless final."""
        if self._after_call:
            text = text.lstrip()
            if text:
                self._after_call = False
        text = self._space + text
        if final:
            self._space = ""
            return text
        kept = text.rstrip()
        self._space = text[len(kept) :]
        return kept
