"""benchmarks/thread_policy.py --smoke: a child per policy (the default wait, and PASSIVE with the tuner) on a tiny
model, a quiet and a busy phase, read back from its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.thread_policy import main


@pytest.mark.slow  # two children each load the model (~25 s on a loaded 2-core machine)
def test_smoke(tiny_llama_dir: Path, tmp_path: Path):
    out = tmp_path / "tp.json"
    result = main(["--smoke", "--model", str(tiny_llama_dir), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [(r["policy"], r["batch"], r["threads"]) for r in result["rows"]] == [
        ("default", 1, 1),
        ("default", 1, 2),
        ("passive_tuned", 1, "tuned"),
    ]
    assert result["rows"][2]["env"] == {"OMP_WAIT_POLICY": "PASSIVE"}
    for row in result["rows"]:
        assert len(row["quiet_samples"]) == len(row["busy_samples"]) == 1
        assert row["quiet_tok_s"] > 0 and row["busy_tok_s"] > 0
    assert [len(v) for v in result["load_average"].values()] == [1, 1]
    assert result["machine"]["cores"] >= 1
