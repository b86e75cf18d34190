"""Smoke test of benchmarks/stop_strings.py: the old scan and the automaton agree on the benchmark's completion, and
the JSON has every field."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.stop_strings import ScanStopChecker, completion, main, stop_set
from runtime.text.stop_strings import StopChecker


def test_before_and_after_release_the_same_text():
    texts = completion(300, seed=1)
    stops = stop_set(64, 64, seed=2) + ["the of", "\n"]  # two that occur: both checkers stop at the same place
    released = []
    for make in (ScanStopChecker, StopChecker):
        checker, ends, out = make(stops), [], []
        for text in texts:
            ends.append(len(text))
            out.append(checker.update(text, ends)[:2])
            if checker.stopped:
                break
        released.append(out)
    assert released[0] == released[1] and released[1][-1][1] is True


def test_smoke_writes_json(tmp_path: Path):
    out = tmp_path / "stop_strings.json"
    result = main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert set(result["us_per_token"]) == {"before", "after"}
    assert set(result["us_per_token"]["after"]) == {"1", "64"} and set(result["build_us"]) == {"1", "64"}
    assert (result["tokens"], result["repeats"], result["stop_len"], result["cores"]) == (200, 1, 64, os.cpu_count())
    assert {"cpu_model", "cpu_capability", "load_average", "speedup_64", "growth_after"} <= set(result)
