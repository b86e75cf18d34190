"""Smoke run of benchmarks/attention_kernel.py (CPU, seconds): it runs and writes the documented JSON schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.slow  # seconds per test: make test-fast leaves it out

FIELDS = {
    "backend",
    "phase",
    "batch",
    "context",
    "heads",
    "dtype",
    "seconds",
    "gbps",
    "fraction_of_copy_bw",
    "vs_contiguous",
    "cpu_seconds",
    "vs_contiguous_cpu",
}
MACHINE = {
    "type",
    "cpu_model",
    "cpu_capability",
    "flags",
    "native_bf16",
    "cores",
    "load_average",
    "torch_threads",
    "torch",
    "copy_gbps",
    "dtype",
}


def test_smoke_writes_rows_for_every_backend(tmp_path: Path) -> None:
    out = tmp_path / "attention_kernel.json"
    gpu_run = {"device": {"type": "cuda", "name": "H200"}, "mode": "full", "rows": [{"backend": "triton"}]}
    out.write_text(json.dumps(gpu_run))  # a GPU run's figures must survive a CPU run
    cmd = [sys.executable, "-m", "benchmarks.attention_kernel", "--smoke", "--device", "cpu", "--threads", "1"]
    cmd += ["--out", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    assert set(data["device"]) == MACHINE and data["device"]["torch_threads"] == 1
    assert data["device"]["type"] == "cpu" and data["mode"] == "smoke" and data["block_size"] == 16
    assert data["other_runs"] == {"cuda": gpu_run}
    rows = data["rows"]
    assert [(r["backend"], r["dtype"], r["batch"], r["context"]) for r in rows] == [
        (backend, dtype, 2, 64)
        for dtype in ("float32", "bfloat16")
        for backend in ("fused", "gather+sdpa", "sdpa_contiguous")
    ]
    for row in rows:
        assert set(row) == FIELDS and row["heads"] == "smollm2 9q/3kv/64" and row["seconds"] > 0
        assert row["phase"] == "decode"
    baselines = [r for r in rows if r["backend"] == "sdpa_contiguous"]
    assert [(r["vs_contiguous"], r["vs_contiguous_cpu"]) for r in baselines] == [(1.0, 1.0), (1.0, 1.0)]
    assert [(r["backend"], r["phase"]) for r in data["step_rows"]] == [
        ("linears_only", "step 2 layers"),
        ("fused", "step 2 layers"),
    ]
    assert [r["vs_fused"] for r in data["step_rows"]][1] == 1.0
    assert [(s["dtype"], sorted(s)) for s in data["summary"]] == [
        (dtype, ["batch", "context", "dtype", "gather+sdpa_over_fused"]) for dtype in ("float32", "bfloat16")
    ]
    assert data["legacy_commit"] is None and isinstance(data["openmp_runtimes"], list)


def test_window_smoke_writes_blocks_read_and_times(tmp_path: Path) -> None:
    """benchmarks/attention_window.py --smoke: context 256 = 16 blocks of 16; window 32 reads keys 224..255, i.e. 2
    blocks per sequence; rows for both backends and dtypes, windowed and full."""
    out = tmp_path / "attention_window.json"
    cmd = [sys.executable, "-m", "benchmarks.attention_window", "--smoke", "--out", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    assert set(data["device"]) == MACHINE - {"copy_gbps", "dtype"} and data["device"]["torch_threads"] == 1
    assert data["mode"] == "smoke" and data["block_size"] == 16
    rows = data["rows"]
    assert [(r["backend"], r["dtype"], r["window"], r["blocks_read"]) for r in rows] == [
        (backend, dtype, window, blocks)
        for dtype in ("float32", "bfloat16")
        for window, blocks in ((None, 32), (32, 4))
        for backend in ("fused", "gather+sdpa")
    ]
    assert {(r["batch"], r["context"], r["blocks_in_context"]) for r in rows} == {(2, 256, 32)}
    assert all(r["seconds"] > 0 and r["cpu_seconds"] >= 0 for r in rows)
    assert [r["vs_full"] for r in rows if r["window"] is None] == [1.0] * 4
