"""Incremental detokenization of one completion: text released token by token, safe across multi-byte characters
split over tokens. A plain per-completion class: no torch, no sockets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


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

    def step(self, token_ids: Sequence[int], hidden: frozenset[int] = frozenset()) -> str:
        """Feed new token ids (O(1) amortized per token); returns the newly decodable text ("" if none yet).

        hidden: ids that add no text (EOS, stop token ids): they get a token_ends entry but are never decoded.
        Mutates text and token_ends (one entry per token fed, hidden ones included).
        """
        out: list[str] = []
        for tid in token_ids:
            chunk = "" if tid in hidden else self._step_one(int(tid))
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
