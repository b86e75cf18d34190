"""The unknown-field rule of the request bodies, as vLLM applies it (its request models allow extra fields since
vLLM PR #10463): a field the request schema does not declare is dropped before the body is converted, and its name
is logged once (a warning per name per process), so a client that sends a newer OpenAI field or another server's
extra (`reasoning_content` in an assistant message, `cache_control` in a content part) is served, and the operator
still sees what is being ignored.

Where the rule applies: the top level of a request body, each of its chat messages, the text parts of a message's
content, and stream_options. "Declared" means a field of the request Struct (runtime.serve.http.openai_schema), so
a field someone adds to a Struct is honoured from then on, never swallowed here; a declared field whose meaning the
server does not implement stays a 400 (openai_schema.UNSUPPORTED).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

MAX_LOGGED_NAMES = 256  # names remembered for the once-per-name warning (a client sending endless names logs no more)
MAX_NAME_CHARS = 64  # a logged name is cut to this many characters
TEXT_PART_KEYS = frozenset({"type", "text"})

_logged: set[str] = set()


def warn_once(where: str, name: str) -> None:
    """Logs "ignoring the unknown field NAME (WHERE)" once per (where, name) in this process, for the first
    MAX_LOGGED_NAMES of them; where: e.g. "request", "messages[]", "messages[].content[]". O(1)."""
    key = f"{where}.{name[:MAX_NAME_CHARS]}"
    if key in _logged or len(_logged) >= MAX_LOGGED_NAMES:
        return
    _logged.add(key)
    logger.warning("ignoring the unknown field %r in %s (logged once per name)", name[:MAX_NAME_CHARS], where)


def drop_unknown(obj: dict[str, Any], declared: frozenset[str] | tuple[str, ...], where: str) -> None:
    """Removes from obj every key not in declared, each logged once (warn_once). Mutates obj; O(len(obj))."""
    for name in [k for k in obj if k not in declared]:
        del obj[name]
        warn_once(where, name)


def drop_unknown_in_body(
    body: dict[str, Any],
    declared: tuple[str, ...],
    message_fields: tuple[str, ...],
    stream_options_fields: tuple[str, ...],
) -> None:
    """Applies the rule to a decoded request body (a JSON object): its top level against declared, each message of
    a "messages" list against message_fields, the keys of each {"type": "text"} content part against
    TEXT_PART_KEYS, and a "stream_options" object against stream_options_fields. Values of the wrong type are left
    as they are (the conversion that follows names them). Mutates body; O(size of the body)."""
    drop_unknown(body, declared, "request")
    options = body.get("stream_options")
    if isinstance(options, dict):
        drop_unknown(options, stream_options_fields, "stream_options")
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for message in messages:
        if not isinstance(message, dict):
            continue
        drop_unknown(message, message_fields, "messages[]")
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                drop_unknown(part, TEXT_PART_KEYS, "messages[].content[]")
