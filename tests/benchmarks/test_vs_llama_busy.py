"""benchmarks/vs_llama_busy.py: the summary and targets on hand-made runs (exact values), the busy process' life, and
one --smoke run (vs_llama_server's smoke: a tiny radixserve vs the stub llama-server, quiet then busy)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import vs_llama_busy as vb


def _run(ours_tpot: float, theirs_tpot: float, ours_decode: float = 40.0) -> dict:
    def engine(tpot: float, decode: float) -> dict:
        return {
            "multi_turn": {"tpot_s": tpot, "output_tok_per_s": 0.5 / tpot},
            "single_stream": {"decode_tok_s": decode},
        }

    return {"engines": {"radixserve-http": engine(ours_tpot, ours_decode), "llama-server": engine(theirs_tpot, 50.0)}}


def test_summary_and_targets_on_hand_made_runs():
    runs = {"quiet": [_run(0.05, 0.1), _run(0.07, 0.1), _run(0.06, 0.1)], "busy": [_run(0.10, 0.4), _run(0.14, 0.4)]}
    s = vb.summarize(runs)
    assert s["quiet"]["radixserve-http"]["tpot_s"] == 0.06 and s["busy"]["radixserve-http"]["tpot_s"] == 0.12
    assert s["quiet"]["ratio"] == {"tpot_s": 0.6, "output_tok_s": 1.6667, "single_stream_decode_tok_s": 0.8}
    assert s["busy"]["ratio"]["tpot_s"] == 0.3
    assert s["tpot_busy_over_quiet"] == 2.0
    assert s["targets"]["tpot_busy_over_quiet"] == {"value": 2.0, "rule": "<=", "target": 2.0, "met": True}
    assert s["targets"]["tpot_ratio_busy_vs_quiet"] == {"value": [0.6, 0.3], "rule": "busy <= quiet", "met": True}
    worse = vb.summarize({"quiet": [_run(0.05, 0.1)], "busy": [_run(0.2, 0.2)]})
    assert worse["tpot_busy_over_quiet"] == 4.0
    assert [t["met"] for t in worse["targets"].values()] == [False, False]


def test_busy_core_runs_a_process_only_inside():
    before = set(os.listdir("/proc"))
    with vb.busy_core(True):
        started = set(os.listdir("/proc")) - before
        assert any(Path(f"/proc/{pid}/cmdline").read_bytes().endswith(vb.BUSY.encode() + b"\0") for pid in started)
    with vb.busy_core(False):
        pass


@pytest.mark.slow  # four server starts (two radixserve, two stub llama-servers)
def test_smoke_quiet_then_busy(tiny_llama_dir: Path, tmp_path: Path):
    out = tmp_path / "busy.json"
    result = vb.main(["--smoke", "--model", str(tiny_llama_dir), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [len(result["runs"][phase]) for phase in vb.PHASES] == [1, 1]
    for phase in vb.PHASES:
        run = result["runs"][phase][0]
        assert list(run["engines"]) == ["radixserve-http", "llama-server"]
        assert run["engines"]["radixserve-http"]["multi_turn"]["requests"] == 4
        figures = result["summary"][phase]
        assert figures["radixserve-http"]["single_stream_decode_tok_s"] > 0
        assert figures["ratio"]["single_stream_decode_tok_s"] == vb.ratio(
            figures["radixserve-http"]["single_stream_decode_tok_s"],
            figures["llama-server"]["single_stream_decode_tok_s"],
        )
    assert set(result["summary"]["targets"]) == {"tpot_busy_over_quiet", "tpot_ratio_busy_vs_quiet"}
