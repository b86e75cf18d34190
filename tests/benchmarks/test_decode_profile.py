"""benchmarks/decode_profile.py --smoke on the tiny random Llama: the profiled ops ranked by self CPU time (shares
that add up to at most 1, in order), the step figures and the machine facts, read back from the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.decode_profile import main, results_path


def test_smoke_ranks_ops_by_self_cpu_time(tiny_llama_dir: Path, tmp_path: Path):
    out = tmp_path / "profile.json"
    result = main(["--smoke", "--model", str(tiny_llama_dir), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    ops = result["top_ops"]
    assert len(ops) == 5
    selfs = [op["self_ms_per_step"] for op in ops]
    assert selfs == sorted(selfs, reverse=True) and selfs[0] > 0
    assert 0 < sum(op["share"] for op in ops) <= 1.0
    assert all(op["total_ms_per_step"] >= op["self_ms_per_step"] and op["calls_per_step"] > 0 for op in ops)
    assert result["step_ms"] > 0 and result["decode_tok_s"] == pytest.approx(1e3 / result["step_ms"], rel=1e-2)
    assert result["config"]["steps"] == 3 and result["config"]["quantization"] == "auto"
    assert {"cpu_model", "cores", "load_average"} <= set(result["machine"])
    assert results_path("gemma3-270m").name == "decode_profile_gemma3-270m.json"
