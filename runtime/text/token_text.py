"""Token ids as text, for answers that name tokens rather than stream a completion: decode_text (a DetokenizeRequest's
text) and TokenTextCache (the text of each generated token and of its top alternatives, which the OpenAI logprobs
formats name). The tokenizer process and the router answer with them, so a client (the HTTP server) needs no
tokenizer of its own. No torch, no sockets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.protocol import TokenLogprobs, TokenText


def decode_text(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """tokenizer.decode(token_ids, skip_special_tokens=False): the text of every id, special tokens included.

    A fast tokenizer that does not clean up tokenization spaces decodes through the Rust decoder's decode_batch,
    which releases the GIL (transformers' decode, through the backend's decode, holds it for the whole call: a
    fraction of a second for a few hundred thousand ids), so the tokenizer process's loop keeps running while its
    PromptWorker thread decodes; it is the same decoder, so the same text. Anything else goes through
    tokenizer.decode. Every id must lie in [0, len(tokenizer)) (the caller checks: the Rust decoder takes u32 ids).
    Cost: O(len(token_ids) + characters of the text).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    batch = getattr(backend, "decode_batch", None)
    if batch is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.decode(list(token_ids), skip_special_tokens=False)
    return batch([list(token_ids)], skip_special_tokens=False)[0]


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
