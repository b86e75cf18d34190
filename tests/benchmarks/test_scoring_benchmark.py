"""Smoke test of benchmarks/scoring.py on the tiny random Llama: every mode runs, the JSON has every field, and the
worker's results grow with the prompt logprobs asked for (only scoring requests pay)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.scoring import main


def test_smoke_writes_json(tmp_path: Path, tiny_llama_dir):
    out = tmp_path / "scoring.json"
    result = main(["--smoke", "--model", str(tiny_llama_dir), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert set(result["seconds"]) == {"prefill", "scoring_k0", "scoring_k5"}
    assert (result["prompts"], result["prompt_len"], result["repeats"]) == (2, 32, 1)
    per_position = result["result_bytes_per_position"]
    assert per_position["prefill"] < per_position["scoring_k0"] < per_position["scoring_k5"]
    assert {"cpu_model", "cpu_capability", "load_average", "overhead_pct"} <= set(result)
