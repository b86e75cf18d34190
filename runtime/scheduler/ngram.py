"""Draft proposers for speculative decoding, scheduler side (it holds every sequence's tokens). Pure Python (no torch).

NgramProposer is prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's `ngram` method): the last n
tokens of the sequence (prompt + output) are looked up earlier in the same sequence, for n from prompt_lookup_max
down to prompt_lookup_min, and the tokens that followed the most recent earlier occurrence are the draft. NoProposer
is speculation off: it proposes nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_ITEM = 4  # bytes per token id in the search buffer (array "i": int32, the vocabulary fits)


class NoProposer:
    """Speculation off: every draft is empty."""

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """[] (no draft)."""
        return []


class NgramProposer:
    """Prompt lookup: proposes up to max_tokens tokens copied from earlier in the sequence.

    Args:
        min_n / max_n: the shortest and longest suffix looked up (tokens), 1 <= min_n <= max_n.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The draft for a sequence whose known tokens are token_ids: the (at most max_tokens) tokens that follow the
        most recent earlier occurrence of its last-n-token suffix, for the longest n in [min_n, max_n] that has an
        occurrence with max_tokens tokens after it, else for the longest n that has any; [] when no suffix recurs or
        max_tokens < 1.

        The search is bytes.rfind over the tokens packed as int32 (C speed), a hit kept only at a token boundary:
        O(len(token_ids) * max_n) per search, at most 2 * (max_n - min_n + 1) searches, one buffer of
        4 * len(token_ids) bytes per call."""
        total = len(token_ids)
        if max_tokens < 1 or total < self.min_n + 1:
            return []
        buf = array("i", token_ids).tobytes()
        # first an occurrence followed by max_tokens tokens (inside a run of one token, the most recent one is
        # followed by a single token), then any occurrence ending before the last token (never the suffix itself)
        for last in (total - max_tokens, total - 1):
            for n in range(min(self.max_n, last), self.min_n - 1, -1):
                hit = _rfind_token(buf, buf[(total - n) * _ITEM :], last)
                if hit >= 0:
                    return list(token_ids[hit + n : hit + n + max_tokens])
        return []


def _rfind_token(buf: bytes, pattern: bytes, last: int) -> int:
    """The token index of the most recent occurrence of pattern (whole tokens) in buf that ends at or before token
    index last (exclusive end), or -1. bytes.rfind, a hit across token boundaries skipped."""
    end = last * _ITEM
    while True:
        hit = buf.rfind(pattern, 0, end)
        if hit < 0 or hit % _ITEM == 0:
            return hit // _ITEM if hit >= 0 else -1
        end = hit + len(pattern) - 1  # a hit across token boundaries: look further left
