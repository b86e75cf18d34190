"""benchmarks/moe_decode.py --smoke: a random Qwen3-MoE (and a Mixtral) decoded at top-k 1 and 2; the rows, the
active-expert counts (at batch 1 exactly top-k per sparse layer) and the machine facts."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.moe_decode import main


def test_smoke_rows_per_top_k(tmp_path: Path):
    out = tmp_path / "moe.json"
    result = main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [(r["top_k"], r["batch"]) for r in result["rows"]] == [(1, 1), (2, 1)]
    assert [r["active_experts"] for r in result["rows"]] == [1.0, 2.0]
    figures = ("decode_tok_s", "decode_tok_per_cpu_s", "prefill_tok_s")
    assert all(r[f] > 0 for r in result["rows"] for f in figures)
    assert result["model"]["family"] == "Qwen3MoeForCausalLM" and result["quantization"] == "none"
    assert {"cpu_model", "cpu_capability", "cores", "load_average"} <= set(result["machine"])


def test_smoke_mixtral_rows_per_top_k():
    result = main(["--smoke", "--family", "mixtral"])
    assert result["model"]["family"] == "MixtralForCausalLM" and result["model"]["experts"] == 16
    assert [(r["top_k"], r["batch"], r["active_experts"]) for r in result["rows"]] == [(1, 1, 1.0), (2, 1, 2.0)]
    assert all(r["decode_tok_s"] > 0 for r in result["rows"])
