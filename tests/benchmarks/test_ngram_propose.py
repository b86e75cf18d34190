"""benchmarks/ngram_propose.py --smoke: a row per context and token source, the index's drafts equal the scan's at
every step, and the copy source drafts at every step."""

from __future__ import annotations

import json

from benchmarks.ngram_propose import main


def test_smoke_run(tmp_path):
    out = tmp_path / "ngram.json"
    result = main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    rows = result["rows"]
    assert [(r["context"], r["source"]) for r in rows] == [(64, "random"), (64, "copy"), (256, "random"), (256, "copy")]
    for r in rows:
        assert r["same_drafts"] is True
        assert r["steps"] == 20
        assert r["scan_us_per_step"] > 0 and r["index_us_per_step"] > 0
        if r["source"] == "copy":
            assert r["steps_with_a_draft"] == 20
    assert result["machine"]["cores"] >= 1
