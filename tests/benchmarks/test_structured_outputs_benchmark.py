"""Smoke test of benchmarks/structured_outputs.py on the tiny random Llama: every figure is there, the grammar did
work on the constrained steps, and the cached compile is faster than the cold one."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.structured_outputs import COMPILE_SCHEMAS, main


def test_smoke_writes_json(tmp_path: Path, tiny_llama_dir):
    out = tmp_path / "structured_outputs.json"
    result = main(["--smoke", "--model", str(tiny_llama_dir), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert set(result["step_ms"]) == {"none", "json", "mixed"}
    assert all(set(v) == {"1", "4"} for v in result["step_ms"].values())
    assert all(ms > 0 for v in result["grammar_ms"].values() for ms in v.values())
    assert set(result["overhead_pct"]) == {"1", "4"}
    assert set(result["compile_ms"]["cold"]) == set(COMPILE_SCHEMAS)
    assert all(result["compile_ms"]["cached"][k] < result["compile_ms"]["cold"][k] for k in COMPILE_SCHEMAS)
    assert {"cpu_model", "cores", "load_average", "model", "dtype"} <= set(result)
