"""Token ids as text, for answers that name tokens rather than stream a completion: TokenTextCache (the text of each
generated token and of its top alternatives, which the OpenAI logprobs formats name). The tokenizer process sends
them with the completion, so a client (the HTTP server) needs no tokenizer of its own. No torch, no sockets."""

from __future__ import annotations

from typing import Any

from runtime.protocol import TokenLogprobs, TokenText


class TokenTextCache:
    """Token id -> its text as one token, tokenizer.decode([id], skip_special_tokens=False) (special tokens named; a
    token that is part of a multi-byte character reads U+FFFD), cached per id: at most one entry per vocabulary id,
    so its memory is bounded by the vocabulary whatever the traffic.

    One per tokenizer process (PromptPrep owns it; every CompletionStream of a request that asks for logprobs shares
    it) and per Engine. Mutated by text() and token_text(), from one thread at a time (the tokenizer process's loop).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        """The text of token_id alone. O(1) once cached; a decode of one id the first time."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text

    def token_text(self, token_id: int, logprobs: TokenLogprobs | None) -> TokenText:
        """The TokenText of a generated token: its text and, aligned with logprobs.top_token_ids, the text of each
        top alternative ([] without logprobs). O(1 + alternatives)."""
        top = [] if logprobs is None else [self.text(t) for t in logprobs.top_token_ids]
        return TokenText(self.text(token_id), top)
