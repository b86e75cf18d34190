"""Draft proposers for speculative decoding, scheduler side (it holds every sequence's tokens). Pure Python (no torch).

NgramProposer is prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's `ngram` method): the last n
tokens of the sequence (prompt + output) are looked up earlier in the same sequence, for n from prompt_lookup_max
down to prompt_lookup_min, and the tokens that followed the most recent earlier occurrence are the draft. NoProposer
is speculation off: it proposes nothing.

Each sequence has an NgramIndex, built as its tokens arrive, so a step's proposal costs O(k * (max_n - min_n + 1))
dictionary look-ups, not a scan of the context: for every n, a dict maps an n-gram to the end of its latest
occurrence and a per-n array links each occurrence to the previous one of the same n-gram (the hash chains of LZ77
match finders, Ziv and Lempel 1977).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_KEY_BITS = 32  # bits per token in an n-gram's key: token ids are below 2**32 (an int, not a tuple: no GC tracking)


class NoProposer:
    """Speculation off: every draft is empty."""

    def propose(self, seq_id: int, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """[] (no draft)."""
        return []

    def release(self, seq_id: int) -> None:
        """Nothing to release."""


class NgramIndex:
    """The n-gram occurrences of one growing token sequence, for prompt lookup.

    Args:
        min_n / max_n: the shortest and longest suffix looked up (tokens), 1 <= min_n <= max_n.
    Memory: one dict entry per distinct n-gram and 4 bytes per token per n, for n in [min_n, max_n].
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        # per n: _latest[n - min_n] maps an n-gram (its key, _KEY_BITS per token) to the end (exclusive token index)
        # of its latest occurrence; _prev[n - min_n][end] is the end of the previous occurrence of the n-gram
        # ending at end, or -1
        self._latest: list[dict[int, int]] = []
        self._prev: list[array[int]] = []
        self._len = 0  # tokens indexed
        self._last_token = -1  # token_ids[_len - 1]: the cheap check that a later call extends the same sequence
        self._reset()

    def _reset(self) -> None:
        """Forget every indexed token."""
        self._latest = [{} for _ in range(self.min_n, self.max_n + 1)]
        self._prev = [array("i", [-1]) for _ in range(self.min_n, self.max_n + 1)]
        self._len = 0
        self._last_token = -1

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The draft for a sequence whose known tokens are token_ids: the (at most max_tokens) tokens that follow the
        most recent earlier occurrence of its last-n-token suffix, for the longest n in [min_n, max_n] that has an
        occurrence with max_tokens tokens after it, else for the longest n that has any; [] when no suffix recurs or
        max_tokens < 1.

        Mutates the index: token_ids past the indexed ones are added (O(max_n) each). token_ids must extend the
        sequence of the previous call (only checked cheaply: a shorter one, or one whose last indexed token changed,
        is re-indexed from the start). The look-up is O(max_tokens * (max_n - min_n + 1)): at most max_tokens + 1
        chain links are followed per n (each occurrence in the last max_tokens tokens is skipped once)."""
        total = len(token_ids)
        if total < self._len or (self._len and token_ids[self._len - 1] != self._last_token):
            self._reset()
        self._extend(token_ids)
        if max_tokens < 1 or total < self.min_n + 1:
            return []
        # first an occurrence followed by max_tokens tokens (inside a run of one token, the most recent one is
        # followed by a single token), then any occurrence ending before the last token (never the suffix itself)
        for last in (total - max_tokens, total - 1):
            for n in range(min(self.max_n, last), self.min_n - 1, -1):
                end = self._latest_end(token_ids, n, last)
                if end >= 0:
                    return list(token_ids[end : end + max_tokens])
        return []

    def _latest_end(self, token_ids: Sequence[int], n: int, last: int) -> int:
        """The end of the most recent occurrence of the last n tokens that ends at or before last, or -1."""
        prev = self._prev[n - self.min_n]
        end = self._latest[n - self.min_n][_key(token_ids, len(token_ids), n)]  # the suffix itself: end == total
        while end > last:
            end = prev[end]
        return end

    def _extend(self, token_ids: Sequence[int]) -> None:
        """Index the n-grams ending at each token past the indexed ones: O(max_n) per token."""
        min_n = self.min_n
        for end in range(self._len + 1, len(token_ids) + 1):
            key = 0
            for n in range(1, self.max_n + 1):  # the key of the n-gram ending at end grows by one token per n
                if n <= end:
                    key |= token_ids[end - n] << (_KEY_BITS * (n - 1))
                if n < min_n:
                    continue
                prev = self._prev[n - min_n]
                if n > end:
                    prev.append(-1)
                    continue
                latest = self._latest[n - min_n]
                prev.append(latest.get(key, -1))
                latest[key] = end
        self._len = len(token_ids)
        if self._len:
            self._last_token = token_ids[self._len - 1]


def _key(token_ids: Sequence[int], end: int, n: int) -> int:
    """The n-gram token_ids[end - n : end] as one int, _KEY_BITS per token (the last token in the low bits)."""
    key = 0
    for i in range(1, n + 1):
        key |= token_ids[end - i] << (_KEY_BITS * (i - 1))
    return key


class NgramProposer:
    """Prompt lookup: proposes up to max_tokens tokens copied from earlier in the sequence, one NgramIndex per
    sequence (made at its first proposal, dropped by release).

    Args:
        min_n / max_n: the shortest and longest suffix looked up (tokens), 1 <= min_n <= max_n.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, seq_id: int, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The draft of sequence seq_id, whose known tokens are token_ids (NgramIndex.propose: the rule, the cost;
        the first call of a sequence indexes its whole context, O(len(token_ids) * (max_n - min_n + 1)))."""
        index = self._indexes.get(seq_id)
        if index is None:
            index = NgramIndex(self.min_n, self.max_n)
            self._indexes[seq_id] = index
        return index.propose(token_ids, max_tokens)

    def release(self, seq_id: int) -> None:
        """Drop seq_id's index (its sequence finished); no-op when it has none."""
        self._indexes.pop(seq_id, None)

    def num_indexed(self) -> int:
        """How many sequences have an index."""
        return len(self._indexes)
