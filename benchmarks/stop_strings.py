"""Stop-string check cost per token: 1 versus 64 stop strings of 64 characters, before and after the Aho-Corasick
StopChecker (runtime/text/stop_strings.py).

"before" is the scan the runtime used until then (kept here as ScanStopChecker: every update runs text.find once per
stop string over a window of max(len(stop)) characters, then tests every suffix of up to max(len(stop)) - 1
characters against every stop string for the hold-back). "after" is runtime.text.stop_strings.StopChecker. Both are fed
the same completion: `tokens` tokens of seeded pseudo-English text (1-8 characters each, words, spaces, newlines),
one update per token, as CompletionStream does; no stop string occurs in it (the check runs for every token), and
each begins with a character the text contains ("\\n"), so the hold-back has work to do.
Times are the median over repeats of the CPU time (time.process_time, garbage collector paused) of one completion,
divided by its tokens; build_us is the time to build the automaton of a set once (the cache is bypassed).

Reported (benchmarks/results/stop_strings.json): us_per_token[impl][num_stops], build_us[num_stops], speedup_64
(before / after at 64 stop strings), growth_after (after at 64 / after at 1; target <= 1.5: independent of the
number of stop strings), and the machine: cpu_model, cpu_capability (torch.backends.cpu.get_cpu_capability()),
cores, load_average (runtime.model.cpu_features.machine_facts).

    .venv/bin/python -m benchmarks.stop_strings           # 2,000 tokens x 5 repeats -> results/stop_strings.json
    .venv/bin/python -m benchmarks.stop_strings --smoke   # a second; writes nothing unless --out is given
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.cli import write_result
from runtime.text.stop_strings import StopAutomaton, StopChecker

RESULTS = Path(__file__).parent / "results" / "stop_strings.json"
WORDS = "the of and to in is was for on that with as by at from his her it an be this are or had not but".split()


class ScanStopChecker:
    """The StopChecker before the automaton (runtime/text/ until the change), for comparison only:
    O(new chars x stops) for the find and O(max_len x stops) for the hold-back, per update."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = list(stop)
        self._max_len = max((len(s) for s in self.stop), default=0)
        self._emitted = 0
        self._scanned = 0
        self.stopped = False

    def update(self, text: str, token_ends: Sequence[int]) -> tuple[str, bool]:
        start = max(0, self._scanned - self._max_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.stopped = True
            return text[self._emitted : best[0]], True
        self._scanned = len(text)
        safe = len(text) - self._held_back(text)
        new_text = text[self._emitted : safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return new_text, False

    def _held_back(self, text: str) -> int:
        for k in range(min(self._max_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


def completion(tokens: int, seed: int) -> list[str]:
    """The texts after each token of a seeded pseudo-English completion (pieces of 1-8 characters)."""
    rng = random.Random(seed)
    pieces: list[str] = []
    while len(pieces) < tokens:
        word = rng.choice(WORDS) + ("\n" if rng.random() < 0.05 else "")
        pieces.append(" " + word if rng.random() < 0.5 or len(word) < 4 else word)
    texts, text = [], ""
    for piece in pieces:
        text += piece
        texts.append(text)
    return texts


def stop_set(num_stops: int, length: int, seed: int) -> list[str]:
    """num_stops distinct stop strings of `length` characters, each "\\n" then seeded letters (none in the text)."""
    rng = random.Random(seed)
    return ["\n" + "".join(rng.choice("QXZJKV") for _ in range(length - 1)) for _ in range(num_stops)]


def time_completion(make_checker, stops: list[str], texts: list[str]) -> float:
    """CPU seconds of one completion's updates (one per token)."""
    ends: list[int] = []  # token_ends, grown one entry per token as the Detokenizer does
    checker = make_checker(stops)
    gc.disable()
    try:
        t0 = time.process_time()
        for text in texts:
            ends.append(len(text))
            checker.update(text, ends)
        elapsed = time.process_time() - t0
    finally:
        gc.enable()
    assert not checker.stopped
    return elapsed


def run(tokens: int, repeats: int, stop_len: int, counts: Sequence[int], seed: int) -> dict:
    texts = completion(tokens, seed)
    impls = {"before": ScanStopChecker, "after": StopChecker}
    us: dict[str, dict[str, float]] = {name: {} for name in impls}
    build: dict[str, float] = {}
    for n in counts:
        stops = stop_set(n, stop_len, seed + n)
        for name, make in impls.items():
            times = [time_completion(make, stops, texts) for _ in range(repeats)]
            us[name][str(n)] = round(statistics.median(times) / tokens * 1e6, 3)
        t0 = time.process_time()
        StopAutomaton(stops)
        build[str(n)] = round((time.process_time() - t0) * 1e6, 1)
    lo, hi = str(min(counts)), str(max(counts))
    return {
        "tokens": tokens,
        "repeats": repeats,
        "stop_len": stop_len,
        "us_per_token": us,
        "build_us": build,
        f"speedup_{hi}": round(us["before"][hi] / max(us["after"][hi], 1e-9), 1),
        "growth_after": round(us["after"][hi] / max(us["after"][lo], 1e-9), 2),
        **_machine_facts(),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000, help="tokens of the completion")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stop-len", type=int, default=64, help="characters per stop string")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="200 tokens, 1 repeat; writes nothing by default")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {RESULTS}; none in --smoke)")
    ns = parser.parse_args(argv)
    if ns.smoke:
        ns.tokens = 200
        ns.repeats = 1
    result = run(ns.tokens, ns.repeats, ns.stop_len, (1, 64), ns.seed)
    write_result(result, ns.out, ns.smoke, RESULTS)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()


def _machine_facts() -> dict:
    """runtime.model.cpu_features.machine_facts (imported here: the measured code imports no torch)."""
    from runtime.model.cpu_features import machine_facts

    return machine_facts()
