"""Smoke run of benchmarks/attention_kernel.py (CPU, seconds): it runs and writes the documented JSON schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"backend", "phase", "batch", "context", "heads", "seconds", "gbps", "fraction_of_copy_bw", "vs_contiguous",
          "cpu_seconds", "vs_contiguous_cpu"}  # fmt: skip


def test_smoke_writes_rows_for_every_backend(tmp_path: Path) -> None:
    out = tmp_path / "attention_kernel.json"
    gpu_run = {"device": {"type": "cuda", "name": "H200"}, "mode": "full", "rows": [{"backend": "triton"}]}
    out.write_text(json.dumps(gpu_run))  # a GPU run's figures must survive a CPU run
    cmd = [sys.executable, "-m", "benchmarks.attention_kernel", "--smoke", "--device", "cpu", "--threads", "1"]
    cmd += ["--out", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["device"]["type"] == "cpu" and data["mode"] == "smoke" and data["block_size"] == 16
    assert data["device"]["torch_threads"] == 1
    assert data["other_runs"] == {"cuda": gpu_run}
    rows = data["rows"]
    assert [(r["backend"], r["phase"], r["batch"], r["context"]) for r in rows] == [
        ("reference", "decode", 2, 64),
        ("reference[gather-all]", "decode", 2, 64),
        ("sdpa_contiguous", "decode", 2, 64),
        ("reference", "extend 16 on 48", 1, 64),
        ("sdpa_contiguous", "extend 16 on 48", 1, 64),
    ]
    for row in rows:
        assert set(row) == FIELDS and row["heads"] == "smollm2 9q/3kv/64" and row["seconds"] > 0
    baselines = [r for r in rows if r["backend"] == "sdpa_contiguous"]
    assert [(r["vs_contiguous"], r["vs_contiguous_cpu"]) for r in baselines] == [(1.0, 1.0), (1.0, 1.0)]
