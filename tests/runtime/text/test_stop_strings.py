"""StopChecker (runtime/text/stop_strings.py): the Aho-Corasick stop-string scan agrees with a brute-force oracle on
every split of the text into updates, and its work per update does not grow with the number of stop strings."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.text.stop_strings import StopAutomaton, StopCheck, StopChecker


class OracleStopChecker:
    """The rule by brute force over the whole text: the earliest-beginning stop string (ties: `stop` order) ends the
    text; otherwise the longest suffix that is a proper prefix of a stop string is held back."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = stop
        self.emitted = 0
        self.result = None

    def update(self, text: str, token_ends: list[int]) -> StopCheck:
        if self.result is not None:
            return StopCheck("", True, *self.result)
        hits = sorted((text.find(s), i) for i, s in enumerate(self.stop) if s in text)
        if hits:
            pos, i = hits[0]
            keep = 0 if pos == 0 else sum(1 for e in token_ends if e < pos) + 1
            new = text[self.emitted : pos]
            self.emitted = pos
            self.result = (keep, self.stop[i])
            return StopCheck(new, True, keep, self.stop[i])
        held = max(
            (k for k in range(1, len(text) + 1) for s in self.stop if len(s) > k and s.startswith(text[-k:])), default=0
        )
        safe = max(self.emitted, len(text) - held)
        new = text[self.emitted : safe]
        self.emitted = safe
        return StopCheck(new, False, len(token_ends), None)


def _updates(checker, pieces: list[str]) -> list[StopCheck]:
    text, ends, out = "", [], []
    for piece in pieces:
        text += piece
        ends.append(len(text))
        out.append(checker.update(text, ends))
    return out


@settings(max_examples=400, deadline=None)
@given(
    stop=st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=6),
    pieces=st.lists(st.text("abc", max_size=4), max_size=12),
)
def test_agrees_with_the_brute_force_rule_on_every_split(stop, pieces):
    assert _updates(StopChecker(stop), pieces) == _updates(OracleStopChecker(stop), pieces)


def test_earliest_start_wins_across_a_later_ending_match_and_ties_go_to_stop_order():
    # "bc" completes first (at 3), but "abcd", completed by the same update, begins earlier
    assert StopChecker(["bc", "abcd"]).update("xabcdy", [6]) == ("x", True, 1, "abcd")
    # split so that "bc" completes in an earlier update: it wins there
    checker = StopChecker(["bc", "abcd"])
    assert checker.update("xabc", [4]) == ("xa", True, 1, "bc")
    assert StopChecker(["abc", "ab"]).update("abc", [3]) == ("", True, 0, "abc")  # same start: `stop` order
    assert StopChecker(["ab", "abc"]).update("abc", [3]) == ("", True, 0, "ab")


def test_automaton_states_hold_back_the_longest_prefix():
    a = StopAutomaton(["abcab", "bca"])
    node = 0
    for ch in "xabca":
        node = a.step(node, ch)
    assert a.depth[node] == 4 and a.match[node] == 3  # "abca" is a prefix of "abcab"; "bca" ends here
    checker = StopChecker(["abcab", "zzz"])
    assert checker.update("xxabca", [6]) == ("xx", False, 1, None)  # "abca" held back
    assert checker.update("xxabcaz", [6, 7]) == ("abca", False, 2, None)  # "z" may begin "zzz"
    assert checker.flush("xxabcaz") == "z"


class _CountingStr(str):
    """A str that counts the method calls and indexing the checker makes on it."""

    calls = 0

    def _count(name):  # noqa: N805 - a helper that builds methods
        def method(self, *args):
            _CountingStr.calls += 1
            return getattr(str, name)(self, *args)

        return method

    find = _count("find")
    startswith = _count("startswith")
    endswith = _count("endswith")
    index = _count("index")
    __getitem__ = _count("__getitem__")
    __contains__ = _count("__contains__")


def _work(num_stops: int) -> int:
    """Calls on the text and on the stop strings over 100 updates of 4 new characters, with num_stops stop strings
    of 64 characters (none of which occurs)."""
    stops = [_CountingStr(f"{i:02d}" + "q" * 62) for i in range(num_stops)]
    checker = StopChecker(stops)
    base = "".join(f"word{i % 10} " for i in range(80))[:400]
    _CountingStr.calls = 0
    for n in range(1, 101):
        checker.update(_CountingStr(base[: 4 * n]), list(range(4, 4 * n + 1, 4)))
    return _CountingStr.calls


def test_work_per_update_does_not_grow_with_the_number_of_stop_strings():
    assert _work(64) == _work(1) == 100 * 4 + 100  # one read per new character, one slice of emitted text each
