"""Tests of benchmarks/http_load.py: the targets on a hand-made result (exact values) and one --smoke run against a
real server behind its HTTP API on the tiny random Llama."""

from __future__ import annotations

import json
from typing import Any

from benchmarks.http_load import evaluate, main


def _result(**over: Any) -> dict[str, Any]:
    result: dict[str, Any] = {
        "errors": {},
        "bad_outputs": {},
        "final_stats": {"num_used_blocks": 0},
        "requests": 10,
        "completed": 8,
        "aborted": 2,
        "idle": {"requests_each": 4},
        "metrics_request_success": {"stop": 3, "length": 15, "abort": 1},
    }
    return {**result, **over}


def test_targets_on_a_hand_made_result():
    ok = evaluate(_result())  # 8 completed + 2 x (4 + 1) idle HTTP requests = 18 served, up to 2 more (aborted)
    assert all(t["met"] for t in ok.values()), ok
    assert ok["completed + idle <= request_success_total{stop, length} <= that + aborted"]["value"] == 18
    assert not evaluate(_result(metrics_request_success={"stop": 3, "length": 14}))[
        "completed + idle <= request_success_total{stop, length} <= that + aborted"
    ]["met"]  # one short
    assert not evaluate(_result(metrics_request_success={"stop": 3, "length": 18}))[
        "completed + idle <= request_success_total{stop, length} <= that + aborted"
    ]["met"]  # one beyond the aborted
    bad = evaluate(
        _result(
            errors={"APIConnectionError": 1},
            final_stats={"num_used_blocks": 3},
            completed=7,
            metrics_request_success={"stop": 1, "length": 2},
        )
    )
    assert {name: t["met"] for name, t in bad.items()} == {
        "errors == 0": False,
        "bad_outputs == 0": True,
        "num_used_blocks == 0 at the end": False,
        "completed + aborted == requests": False,
        "completed + idle <= request_success_total{stop, length} <= that + aborted": False,
    }
    assert bad["num_used_blocks == 0 at the end"]["value"] == 3


def test_smoke_run_keeps_every_invariant(tiny_llama_dir, tmp_path):
    out = tmp_path / "http_load.json"
    main(["--smoke", "--model", str(tiny_llama_dir), "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["errors"] == {} and result["bad_outputs"] == {}
    assert result["final_stats"]["num_used_blocks"] == 0
    assert result["completed"] + result["aborted"] == result["requests"] and result["completed"] > 0
    unmet = {name: t for name, t in result["targets"].items() if not t["met"]}
    assert not unmet, (unmet, result["metrics_request_success"], result["completed"], result["aborted"])
    assert result["idle"]["requests_each"] == 4 and result["idle"]["http_ttft_p50_s"] > 0
    assert result["idle"]["raw_http_ttft_p50_s"] > 0
    assert result["ttft_p99_s"] >= result["ttft_p50_s"] > 0
    assert {"cpu_model", "cpu_capability", "cores", "load_avg_start", "load_avg_end"} <= set(result["machine"])
