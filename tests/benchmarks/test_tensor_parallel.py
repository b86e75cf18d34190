"""benchmarks/tensor_parallel.py --smoke: TP = 1 in process and TP = 2 as two gloo rank processes on a tiny random
Llama (2 layers, hidden 64, vocab 512); the per-step collectives counted exactly: one all-reduce per row-parallel
projection (2 per layer) and one for the embedding, one all-gather of the logits, the relay's two broadcasts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.tensor_parallel import main


@pytest.mark.slow  # two rank processes start torch: ~30 s on 2 shared cores
def test_smoke_counts_the_collectives_of_each_step(tmp_path: Path):
    out = tmp_path / "tp.json"
    result = main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [run["tp"] for run in result["runs"]] == [1, 2]
    assert all(
        row[phase]["tok_s"] > 0 for run in result["runs"] for row in run["rows"] for phase in ("prefill", "decode")
    )
    [row] = result["runs"][1]["rows"]
    decode = row["decode"]
    layers, hidden, vocab, fp32 = 2, 64, 512, 4
    assert decode["all_reduce_calls_per_step"] == 2 * layers + 1
    assert decode["all_reduce_bytes_per_step"] == (2 * layers + 1) * hidden * fp32  # batch 1: one row per step
    assert decode["all_gather_calls_per_step"] == 1
    assert decode["all_gather_bytes_per_step"] == vocab // 2 * fp32  # each rank sends its half of the logits
    assert decode["broadcast_calls_per_step"] == 2  # the relay: the length, then the ForwardBatch bytes
    assert row["prefill"]["all_reduce_bytes_per_step"] == (2 * layers + 1) * 16 * hidden * fp32  # 16 prompt tokens
    assert {"cpu_model", "cores", "load_average"} <= set(result["machine"])
