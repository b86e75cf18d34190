"""Which chat template renders a chat, and with what: the model's own template, a `--chat-template FILE` in its
place, or (for a chat with tools on a ChatML model whose template knows no tools) the repository's ChatML tool
template, runtime/text/templates/chatml_tools.jinja; and the checked keyword arguments of apply_chat_template.

The rule for tools (documented in the README): a template that mentions `tools` renders them itself; a ChatML
template (one that writes <|im_start|>, as SmolLM2-Instruct's does) that does not is replaced by the shipped ChatML
tool template for chats with tools, tool calls or tool results (it renders a chat without them exactly as
SmolLM2-Instruct's own template does); any other template is refused for such a chat (ChatTemplateError), since it
would silently drop the tools.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).resolve().parent / "templates"
CHATML_TOOLS = TEMPLATES / "chatml_tools.jinja"
MAX_TEMPLATE_BYTES = 1 << 20

# apply_chat_template's own arguments: chat_template_kwargs may not set them (a request could otherwise swap the
# template, its tools or the tokenization), nor the variables the template gets from the request itself.
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatTemplateFileError(ValueError):
    """A --chat-template file cannot be read (missing, not UTF-8, over MAX_TEMPLATE_BYTES); the message names it."""


def read_chat_template(path: str | Path) -> str:
    """The text of a Jinja chat template file (vLLM's --chat-template). Raises ChatTemplateFileError."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_TEMPLATE_BYTES:
            raise ChatTemplateFileError(f"chat template {p} is over {MAX_TEMPLATE_BYTES} bytes")
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateFileError(f"chat template {p} cannot be read: {exc}") from None


@functools.cache
def chatml_tool_template() -> str:
    """The shipped ChatML tool template's text (read once)."""
    return read_chat_template(CHATML_TOOLS)


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    """True when a message is a tool result or carries tool calls."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def template_for(own: str, tools: bool) -> str | None:
    """The template to render a chat with: own (the tokenizer's, or the --chat-template file's); for a chat with
    tools (or tool turns) and an own template that does not mention tools, the ChatML tool template when own is
    ChatML, else None (no template can render the tools)."""
    if not tools or "tools" in own:
        return own
    if "<|im_start|>" in own:
        return chatml_tool_template()
    return None


def reserved_kwargs(kwargs: dict[str, Any]) -> list[str]:
    """The keys of chat_template_kwargs that are apply_chat_template's own arguments (sorted; [] when none)."""
    return sorted(k for k in kwargs if k in RESERVED_KWARGS)


def override_chat_template(tokenizer: Any, path: str | None) -> Any:
    """tokenizer, its chat_template replaced by the text of the file at path (ServerArgs.chat_template) when path is
    set. Raises ChatTemplateFileError."""
    if path is not None:
        tokenizer.chat_template = read_chat_template(path)
    return tokenizer


def tool_chars(messages: Any, options: Any) -> int:
    """Characters a chat renders beyond its messages' roles and contents (which runtime.prompt_check.prompt_chars
    counts): the tools' JSON (ChatOptions.tools) and each tool call's name, arguments and id, and each tool_call_id.
    Counted against the same character limit before rendering. O(size of the tools and calls)."""
    total = 0
    tools = getattr(options, "tools", None)
    if tools:
        total += len(json.dumps(tools, ensure_ascii=False, default=str))
    for m in messages or ():
        for call in getattr(m, "tool_calls", None) or ():
            total += len(call.id) + len(call.name) + len(call.arguments)
        call_id = getattr(m, "tool_call_id", None)
        if isinstance(call_id, str):
            total += len(call_id)
    return total
