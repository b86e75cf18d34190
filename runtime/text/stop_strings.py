"""Stop strings: find them in a growing completion text, holding back text that could still begin one.

One Aho-Corasick automaton (Aho & Corasick, "Efficient string matching", CACM 1975) per set of stop strings, built in
O(total stop length) and shared by every completion that uses the same set; each completion keeps only its state (a
node of the trie). Fed only the new characters, a completion finds the earliest stop string and its hold-back length
(the state's depth: the longest suffix of the text that is a prefix of a stop string) in O(new characters) amortized,
whatever the number of stop strings.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple


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


class StopAutomaton:
    """The Aho-Corasick automaton of a set of stop strings. Immutable once built; node 0 is the root (empty string).

    Per node: goto (char -> child), fail (the node of the longest proper suffix that is in the trie), depth (its
    string's length), match (length of the longest stop string that is a suffix of its string, 0 if none).
    Build: O(total stop length) time and memory.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.match = [0]
        for s in stop:
            node = 0
            for ch in s:
                nxt = self.goto[node].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[node][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.match.append(0)
                node = nxt
            self.match[node] = len(s)
        self.fail = [0] * len(self.goto)
        queue = deque(self.goto[0].values())
        while queue:  # breadth first: a node's fail link is final before its children's are computed
            node = queue.popleft()
            if not self.match[node]:
                self.match[node] = self.match[self.fail[node]]
            for ch, child in self.goto[node].items():
                f = self.fail[node]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                self.fail[child] = self.goto[f].get(ch, 0)
                queue.append(child)

    def step(self, node: int, ch: str) -> int:
        """The node after reading ch from node (amortized O(1) over a text)."""
        goto, fail = self.goto, self.fail
        while True:
            nxt = goto[node].get(ch)
            if nxt is not None:
                return nxt
            if not node:
                return 0
            node = fail[node]


@lru_cache(maxsize=16)  # <= ~1 MB each at the protocol's bound (total stop length <= 4096 characters)
def _automaton(stop: tuple[str, ...]) -> StopAutomaton:
    """The automaton of a set of stop strings, shared by the completions (and requests) that use the same set."""
    return StopAutomaton(stop)


class StopChecker:
    """Finds stop strings in a growing completion text, holding back text that could still begin one.

    The rule: among the stop strings that occur in the text, the one that begins first wins (on a tie, the first in
    `stop` order); the completion ends right before it. Within one update every occurrence completed by the new text
    competes, so the result does not depend on how the text was split into updates unless an earlier update already
    stopped.
    Hold-back: the longest suffix of the text that is a proper prefix of some stop string is not emitted until the
    next tokens decide it, so a client never sees the start of a stop string (vLLM / TGI behavior).
    Cost: O(total stop length) once per distinct set of stop strings (cached), then O(new characters) amortized per
    update, independent of the number of stop strings; O(total stop length) once when a stop string is found.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = list(stop)
        self._automaton = _automaton(tuple(self.stop))
        self._max_len = max((len(s) for s in self.stop), default=0)
        self._node = 0  # automaton state after reading text[: self._scanned]
        self._emitted = 0
        self._scanned = 0
        self.stopped = False
        self._keep = 0  # set with stopped
        self._stop_string: str | None = None

    def update(self, text: str, token_ends: Sequence[int]) -> StopCheck:
        """Check `text` (the whole completion so far; it only grows between calls) for stop strings.

        Args:
            text: the completion text emitted by the Detokenizer so far.
            token_ends: the Detokenizer's token_ends (len(text) after each token, characters).
        Returns:
            StopCheck; once stopped, later calls return ("", True, keep, stop) with the first result's values.
        Mutates: the automaton state, the emitted position, and the stopped flag.
        """
        if self.stopped:
            return StopCheck("", True, self._keep, self._stop_string)
        pos = self._scan(text)
        if pos is not None:
            s = next(s for s in self.stop if text.startswith(s, pos))  # the first in `stop` order beginning at pos
            new_text = text[self._emitted : pos]
            self._emitted = pos
            self.stopped = True
            self._stop_string = s
            self._keep = 0 if pos == 0 else bisect.bisect_left(token_ends, pos) + 1
            return StopCheck(new_text, True, self._keep, s)
        safe = len(text) - self._automaton.depth[self._node]
        new_text = text[self._emitted : safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return StopCheck(new_text, False, len(token_ends), None)

    def skip_to(self, pos: int) -> None:
        """Look for stop strings only from character pos on: text before it counts as emitted and scanned, and no
        stop string begins in it (min_tokens: runtime/text/completion_stream.py). O(1); no-op once stopped."""
        if self.stopped or pos <= self._scanned:
            return
        self._node = 0
        self._scanned = pos
        self._emitted = max(self._emitted, pos)

    def _scan(self, text: str) -> int | None:
        """Feeds text[scanned:] to the automaton; the start of the earliest stop string it completes, else None.

        After the first match it reads on only while a later-ending stop string could still begin earlier (at most
        max(len(stop)) characters)."""
        a, node, best = self._automaton, self._node, None
        match, step = a.match, a.step
        for end in range(self._scanned + 1, len(text) + 1):
            if best is not None and end - self._max_len >= best:
                break
            node = step(node, text[end - 1])
            if match[node] and (best is None or end - match[node] < best):
                best = end - match[node]
        self._node = node
        self._scanned = len(text)
        return best

    def flush(self, text: str) -> str:
        """The held-back text, to emit when the completion ends for another reason (length, EOS, abort)."""
        if self.stopped:
            return ""
        rest = text[self._emitted :]
        self._emitted = len(text)
        return rest
