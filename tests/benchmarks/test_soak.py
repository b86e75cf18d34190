"""Tests of benchmarks/soak.py: the output checks and the RSS growth on hand-made values (exact), and one --smoke run
against a real smollm2 server: the JSON's keys and the invariants every run must keep."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from benchmarks.load.outcome import check_output, token_range
from benchmarks.soak import evaluate, main, rss_growth
from runtime import protocol as p


def _check(
    reason: str | None,
    usage: p.Usage | None,
    ids: int,
    max_tokens: int = 8,
    prompt_len: int = 20,
    max_model_len: int = 64,
) -> list[str]:
    return check_output(reason, usage, ids, max_tokens, prompt_len, max_model_len)


def test_check_output_accepts_consistent_streams():
    assert _check("length", p.Usage(20, 16, 8), 8) == []
    assert _check("stop", p.Usage(20, 0, 3), 3) == []
    assert _check("length", p.Usage(20, 0, 5), 5, max_model_len=25) == []  # the context is full


def test_check_output_names_each_inconsistency():
    assert _check("abort", p.Usage(20, 0, 8), 8) == ["finish_reason 'abort'"]
    assert _check(None, None, 0) == ["finish_reason None"]
    assert _check("stop", None, 3) == ["no usage"]
    assert _check("stop", p.Usage(20, 0, 3), 4) == ["completion_tokens != len(token_ids)"]
    assert _check("length", p.Usage(20, 0, 9), 9) == ["completion_tokens > max_tokens"]
    assert _check("length", p.Usage(20, 0, 5), 5) == ["length below max_tokens, context not full"]
    assert _check("stop", p.Usage(20, 21, 3), 3) == ["cached_tokens outside [0, prompt_tokens]"]
    assert _check("stop", p.Usage(19, 0, 3), 3) == ["prompt_tokens != chat template length"]
    assert _check("length", p.Usage(20, 30, 4), 5) == [
        "completion_tokens != len(token_ids)",
        "length below max_tokens, context not full",
        "cached_tokens outside [0, prompt_tokens]",
    ]


def test_rss_growth_from_the_first_sample_at_or_after_the_start():
    series: list[list[Any]] = [[0.0, 500], [10.0, 1000], [20.0, None], [30.0, 1020]]
    assert rss_growth(series, 10.0) == pytest.approx(0.02)
    assert rss_growth(series, 5.0) == pytest.approx(0.02)  # from the sample at 10 s
    assert rss_growth(series, 30.0) is None  # nothing after the start
    assert rss_growth([[0.0, None]], 0.0) is None


def test_rss_targets_judged_only_for_runs_of_five_minutes():
    series = [[0.0, 100], [120.0, 100], [600.0, 106]]
    result: dict[str, Any] = {
        "errors": {},
        "bad_outputs": {"no usage": 1},
        "final_stats": {"num_used_blocks": 0},
        "requests": 3,
        "completed": 2,
        "aborted": 1,
        "rss_kb": {r: series for r in ("worker", "scheduler", "tokenizer")},
    }
    long_run = evaluate(result, 600.0)
    assert long_run["bad_outputs == 0"] == {"value": 1, "met": False}
    assert long_run["completed + aborted == requests"] == {"value": 3, "met": True}
    assert long_run["scheduler RSS growth from 120 s <= +5%"] == {"value": 0.06, "met": False}
    short_run = evaluate(result, 180.0)
    assert short_run["scheduler RSS growth from 60 s <= +5%"] == {"value": 0.06, "met": None}


def test_token_range():
    assert token_range("16:64") == (16, 64) and token_range("8") == (8, 8)
    with pytest.raises(ValueError, match="bad token range '9:3'"):
        token_range("9:3")


def test_smoke_run_keeps_every_invariant(tmp_path):
    out = tmp_path / "soak.json"
    main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result) == {
        "requests",
        "completed",
        "aborted",
        "errors",
        "bad_outputs",
        "ttft_p50_s",
        "ttft_p99_s",
        "latency_p50_s",
        "latency_p99_s",
        "rss_kb",
        "final_stats",
        "stats_samples",
        "config",
        "machine",
        "targets",
    }
    assert result["errors"] == {} and result["bad_outputs"] == {}
    assert result["final_stats"]["num_used_blocks"] == 0
    assert result["completed"] + result["aborted"] == result["requests"] and result["completed"] > 0
    assert set(result["final_stats"]) == set(msgspec.structs.asdict(p.ServerStats()))
    assert set(result["rss_kb"]) == {"worker", "scheduler", "tokenizer"}
    assert all(len(s) >= 3 and all(kb > 0 for _t, kb in s) for s in result["rss_kb"].values())
    assert {"cpu_model", "cpu_capability", "cores", "load_avg_start", "load_avg_end"} <= set(result["machine"])
    assert all(t["met"] for name, t in result["targets"].items() if "RSS" not in name)
