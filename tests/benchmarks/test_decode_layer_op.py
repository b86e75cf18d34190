"""benchmarks/decode_layer_op.py --smoke on the tiny random Llama (bfloat16, int4: the op runs its layers): both
settings timed and profiled, the op's step runs fewer torch ops than the Python layer's, the machine facts recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.decode_layer_op import main


def test_smoke_times_both_settings_and_counts_their_ops(tiny_llama_dir: Path, tmp_path: Path):
    out = tmp_path / "op.json"
    args = ["--smoke", "--model", str(tiny_llama_dir), "--dtype", "bfloat16", "--quantization", "int4"]
    result = main([*args, "--out", str(out)])
    assert json.loads(out.read_text()) == result
    op = result["settings"]["op"]
    python = result["settings"]["python"]
    assert op["step_ms"] > 0 and python["step_ms"] > 0
    assert op["decode_tok_s"] == pytest.approx(1e3 / op["step_ms"], rel=1e-2)
    # 2 layers: the Python layer runs dozens of ops each, the op one call (its qgemv and attention calls inside)
    assert op["ops_per_step"] < python["ops_per_step"] - 20
    assert result["op_speedup"] == pytest.approx(python["step_ms"] / op["step_ms"], rel=1e-2)
    assert result["config"]["blocks"] == 2 and result["resolved_dtype"] == "bfloat16"
    assert {"cpu_model", "cores", "load_average"} <= set(result["machine"])
