"""benchmarks/http_overhead.py --smoke against the tiny model: the JSON it writes and the relations every run keeps
(timings are reported, never asserted)."""

from __future__ import annotations

import json
import os

from benchmarks.http_overhead import main, summary


def test_summary_is_exact():
    assert summary([0.004, 0.001, 0.002, 0.003]) == {"p50_ms": 2.5, "p90_ms": 3.0, "mean_ms": 2.5, "n": 4}


def test_smoke_run_writes_the_results(tiny_llama_dir, tmp_path):
    out = tmp_path / "http_overhead.json"
    assert main(["--smoke", "--model", str(tiny_llama_dir), "--out", str(out), "--logs", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert (result["rounds"], result["warmup"]) == (5, 2)
    assert {name: s["n"] for name, s in result["ttft"].items()} == {"zmq": 5, "http": 5, "openai": 5}
    assert all(s["p50_ms"] > 0 for s in result["ttft"].values())
    assert result["overhead_ms"]["http"] == result["ttft"]["http"]["p50_ms"] - result["ttft"]["zmq"]["p50_ms"]
    assert result["target"]["met"] == (result["overhead_ms"]["http"] <= 3.0)
    assert result["machine"]["cores"] == len(os.sched_getaffinity(0))  # the cores this process may run on
    assert {"cpu_model", "cpu_capability", "load_before", "load_after"} <= set(result["machine"])
