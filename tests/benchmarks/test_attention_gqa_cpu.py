"""benchmarks/attention_gqa_cpu.py --smoke --base tree: both kernels timed on both head shapes, their outputs the same
bits, the result written where --out says with the machine facts (the base built from this checkout: a clone without
git history runs it too)."""

from __future__ import annotations

import json

import pytest

from benchmarks.attention_gqa_cpu import main


@pytest.mark.slow  # builds the kernel under another name on the first run on a machine (~20 s), then a few seconds
def test_smoke_times_both_kernels_on_both_shapes(tmp_path):
    out = tmp_path / "gqa.json"
    result = main(["--smoke", "--base", "tree", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [(r["heads"], r["batch"], r["context"]) for r in result["rows"]] == [
        ("smollm2 9q/3kv/64", 2, 40),
        ("gemma3-270m 4q/1kv/256", 2, 40),
    ]
    for row in result["rows"]:
        assert row["base_us"] > 0 and row["grouped_us"] > 0
        assert row["speedup"] == pytest.approx(row["base_us"] / row["grouped_us"], rel=1e-2)
        assert row["max_abs_difference"] == 0.0
    assert result["config"] == {"threads": 1, "layers": 2, "rounds": 3}
    assert result["base_commit"] == "tree"
    assert {"cpu_model", "cores", "load_average"} <= set(result["machine"])
