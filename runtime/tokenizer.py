"""Text side of serving: incremental detokenization, stop strings with hold-back, and chat-template application.

Detokenizer and StopChecker are plain per-completion classes with no torch and no sockets: the Engine uses them in
process, and the tokenizer process wraps the same classes around its ZeroMQ loop.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template, or the messages are malformed (the message says which)."""


class Detokenizer:
    """Incremental detokenization of one completion, safe across multi-byte characters split over tokens.

    With a fast tokenizer (one exposing `backend_tokenizer`) this uses tokenizers' `DecodeStream`, which buffers
    tokens until they decode to valid UTF-8. Otherwise it decodes a sliding window (the prefix/read offset scheme of
    Hugging Face's TextStreamer): text is emitted only when the window's decoding does not end in U+FFFD.
    Either way `text` always equals `tokenizer.decode(token_ids, skip_special_tokens=...)` once every pending
    multi-byte sequence is complete, and never contains a replacement character that a later token would fix.

    State (mutated by step):
        text: the completion text emitted so far (str).
        token_ends: token_ends[i] = len(text) after token i was fed (characters); tokens that complete nothing
            (a partial multi-byte character, a skipped special token) repeat the previous value.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.text = ""
        self.token_ends: list[int] = []
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        else:
            self._ids: list[int] = []
            self._prefix_offset = 0
            self._read_offset = 0

    def step(self, token_ids: Sequence[int]) -> str:
        """Feed new token ids (O(1) amortized per token); returns the newly decodable text ("" if none yet).

        Mutates text and token_ends (one entry per token fed).
        """
        out: list[str] = []
        for tid in token_ids:
            chunk = self._step_one(int(tid))
            if chunk:
                out.append(chunk)
                self.text += chunk
            self.token_ends.append(len(self.text))
        return "".join(out)

    def _step_one(self, tid: int) -> str:
        if self._backend is not None:
            return self._stream.step(self._backend, tid) or ""
        self._ids.append(tid)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        window = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
        if len(window) > len(prefix) and not window.endswith(REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return window[len(prefix) :]
        return ""


class StopCheck(NamedTuple):
    """Result of StopChecker.update.

    new_text: text that is now safe to emit (never a possible start of a stop string, never past one).
    stopped: a stop string was found; the completion ends before it.
    keep_tokens: completion tokens to keep (all fed tokens when not stopped); the scheduler inserts no KV block past
        prompt + keep_tokens into the cache.
    stop_string: the stop string found, else None.
    """

    new_text: str
    stopped: bool
    keep_tokens: int
    stop_string: str | None


class StopChecker:
    """Finds stop strings in a growing completion text, holding back text that could still begin one.

    Hold-back: the longest suffix of the text that is a proper prefix of some stop string is not emitted until the
    next tokens decide it, so a client never sees the start of a stop string (vLLM / TGI behavior).
    Each update scans only the new text plus max(len(stop)) - 1 characters before it: O(new chars x stops).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = list(stop)
        self._max_len = max((len(s) for s in self.stop), default=0)
        self._emitted = 0
        self._scanned = 0
        self.stopped = False

    def update(self, text: str, token_ends: Sequence[int]) -> StopCheck:
        """Check `text` (the whole completion so far) for stop strings.

        Args:
            text: the completion text emitted by the Detokenizer so far.
            token_ends: the Detokenizer's token_ends (len(text) after each token, characters).
        Returns:
            StopCheck; once stopped, later calls return ("", True, keep, stop) with the first result's values.
        Mutates: the emitted position, and the stopped flag.
        """
        if self.stopped:
            return StopCheck("", True, self._keep, self._stop_string)
        start = max(0, self._scanned - self._max_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            pos, s = best
            new_text = text[self._emitted : pos]
            self._emitted = pos
            self.stopped = True
            self._stop_string = s
            self._keep = 0 if pos == 0 else bisect.bisect_left(token_ends, pos) + 1
            return StopCheck(new_text, True, self._keep, s)
        self._scanned = len(text)
        safe = len(text) - self._held_back(text)
        new_text = text[self._emitted : safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return StopCheck(new_text, False, len(token_ends), None)

    def flush(self, text: str) -> str:
        """The held-back text, to emit when the completion ends for another reason (length, EOS, abort)."""
        if self.stopped:
            return ""
        rest = text[self._emitted :]
        self._emitted = len(text)
        return rest

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        for k in range(min(self._max_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


def apply_chat_template(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True
) -> list[int]:
    """Render `messages` with the tokenizer's chat template and tokenize the result.

    Args:
        tokenizer: a transformers tokenizer with a chat template (runtime.model.loader.load_tokenizer).
        messages: [{"role": "system" | "user" | "assistant", "content": str}, ...].
        add_generation_prompt: append the assistant turn header so the model answers.
    Returns:
        the prompt token ids (list[int]); the template's own special tokens are kept, none are added twice.
    Raises:
        ChatTemplateError: no chat template, or a message without role/content.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError("the tokenizer has no chat template; pass prompts or input_ids instead")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatTemplateError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))
