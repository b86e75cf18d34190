"""benchmarks/batch_decode.py --smoke on the tiny random Llama (bfloat16, int4): the three settings timed per case,
the ratios taken from those medians, each Engine's ISA recorded (the first never the bfloat16 dot products)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.batch_decode import SETTINGS, main
from kernels import cpu_qgemv
from runtime.model.cpu_features import cpu_flags


def test_smoke_times_the_three_settings(tiny_llama_dir: Path, tmp_path: Path):
    out = tmp_path / "batch.json"
    args = ["--smoke", "--model", str(tiny_llama_dir), "--dtype", "bfloat16", "--quantization", "int4"]
    result = main([*args, "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [(c["batch"], c["context"]) for c in result["cases"]] == [(1, 24), (2, 24)]
    for case in result["cases"]:
        ms = case["step_ms"]
        assert set(ms) == set(SETTINGS) and all(v > 0 for v in ms.values())
        assert case["bf16_speedup"] == pytest.approx(ms["vnni"] / ms["bf16"], rel=1e-2)
        assert case["attention_speedup"] == pytest.approx(ms["bf16"] / ms["bf16+attention"], rel=1e-2)
    assert result["isas"]["vnni"] != "avx512_bf16"
    assert result["isas"]["bf16"] == cpu_qgemv.isa_for(cpu_flags())
    assert not cpu_qgemv.helper_on()  # the benchmark turns the helper off again
    assert {"cpu_model", "cores", "load_average"} <= set(result["machine"])
