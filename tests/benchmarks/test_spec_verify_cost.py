"""benchmarks/spec_verify_cost.py --smoke on the tiny random Llama: a row per batch size with decode and full-draft
verify steps timed, the fit's c, and the model ratio recomputed from it."""

from __future__ import annotations

import json

import pytest

from benchmarks.spec_verify_cost import fit, main


def test_fit_is_exact_on_a_line():
    assert fit([(1, 3.0), (5, 11.0), (2, 5.0)]) == pytest.approx((1.0, 2.0))


def test_smoke_run(tiny_llama_dir, tmp_path):
    out = tmp_path / "cost.json"
    result = main(["--smoke", "--model", str(tiny_llama_dir), "--dtype", "float32", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [r["batch_size"] for r in result["rows"]] == [1, 2]
    c = result["tokens_cost_c"]
    for r in result["rows"]:
        assert r["decode_steps"] >= 3 and r["verify_steps"] >= 3  # every decode step of the ngram Engine verifies
        assert r["decode_cpu_ms"] > 0 and r["verify_cpu_ms"] > 0
        # ratio is of the unrounded medians; the ms are rounded to 0.01 (a tiny model's step is about 1 ms)
        assert r["ratio"] == pytest.approx(r["verify_cpu_ms"] / r["decode_cpu_ms"], rel=5e-2)
        b = r["batch_size"]
        if c is None:  # the two points fit no line with a positive fixed cost
            assert r["model_ratio"] is None
        else:
            assert r["model_ratio"] == pytest.approx((1 + c * b * 5) / (1 + c * b), rel=1e-2)
    assert result["k"] == 4 and result["machine"]["cores"] >= 1
