"""benchmarks/qgemv_accuracy.py: the smoke run measures every projection kind's errors and the agreement of both
paths, with the op's error below int8 activations' (llama.cpp's Q8 scheme) and below torch's bfloat16 path's."""

from __future__ import annotations

import pytest

from benchmarks.qgemv_accuracy import KINDS, main
from kernels import cpu_qgemv


@pytest.mark.slow  # transformers' SmolLM2 and two quantized runners: 203 s measured at load average ~10
def test_smoke_run_measures_every_kind_and_both_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_qgemv, "ENABLED", cpu_qgemv.ENABLED)  # main() turns the op on: undone after
    out = tmp_path / "acc.json"
    result = main(["--smoke", "--out", str(out)])
    assert out.exists() and result["machine"]["load_average"] is not None
    assert set(result["layers"]) == set(KINDS)
    for kind, e in result["layers"].items():
        # int16 rounding per group of 32 is ~256x finer than int8's; the torch path rounds x and y to bfloat16
        assert 0 < e["op_worst"] < e["int8_x_mean"] / 20 and e["op_worst"] < e["torch_mean"] / 5, kind
    agreement = result["agreement"]["bfloat16"]
    assert agreement["positions"] == 11 and 0 <= agreement["qgemv"] <= 1 and 0 <= agreement["torch_kernels"] <= 1
