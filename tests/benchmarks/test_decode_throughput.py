"""Tests of benchmarks/decode_throughput.py: the per-dtype ratios on hand-made rows (exact values) and --smoke runs on
the tiny random Llama with float32 and auto side by side, and on a random model per architecture (--architectures)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.decode_throughput import dtype_ratios, main
from runtime.model.cpu_features import resolve_dtype


def _row(engine: str, dtype: str, batch: int, decode: float, decode_cpu: float) -> dict:
    resolved = "bfloat16" if dtype == "auto" else dtype
    return {
        "engine": engine,
        "dtype": dtype,
        "resolved_dtype": resolved,
        "batch": batch,
        "decode_tok_s": decode,
        "decode_tok_per_cpu_s": decode_cpu,
    }


def test_dtype_ratios_on_hand_made_rows():
    rows = [
        _row("radixserve", "float32", 1, 10.0, 12.0),
        _row("radixserve", "auto", 1, 8.0, 9.0),
        _row("transformers", "float32", 1, 5.0, 6.0),
        _row("radixserve", "float32", 8, 40.0, 40.0),
        _row("radixserve", "auto", 8, 100.0, 90.0),
        _row("transformers", "float32", 8, 50.0, 45.0),
    ]
    assert dtype_ratios(rows, ["float32", "auto"]) == {
        "float32": {
            "resolved_dtype": "float32",
            "vs_transformers": {"1": 2.0, "8": 0.8},
            "vs_transformers_cpu_time": {"1": 2.0, "8": 0.889},
            "vs_float32": {"1": 1.0, "8": 1.0},
        },
        "auto": {
            "resolved_dtype": "bfloat16",
            "vs_transformers": {"1": 1.6, "8": 2.0},
            "vs_transformers_cpu_time": {"1": 1.5, "8": 2.0},
            "vs_float32": {"1": 0.8, "8": 2.5},
        },
    }
    without_f32 = [r for r in rows if r["dtype"] != "float32" or r["engine"] == "transformers"]
    assert dtype_ratios(without_f32, ["auto"]) == {
        "auto": {
            "resolved_dtype": "bfloat16",
            "vs_transformers": {"1": 1.6, "8": 2.0},
            "vs_transformers_cpu_time": {"1": 1.5, "8": 2.0},
        }
    }


def test_smoke_runs_float32_and_auto_side_by_side(tiny_llama_dir: Path, tmp_path: Path):
    out = tmp_path / "decode.json"
    result = main(["--smoke", "--model", str(tiny_llama_dir), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    auto = str(resolve_dtype("auto", "cpu")).removeprefix("torch.")
    per_batch = [
        ("radixserve", "float32", "float32"),
        ("radixserve", "auto", auto),
        ("transformers", "float32", "float32"),
    ]
    assert [(r["engine"], r["dtype"], r["resolved_dtype"], r["batch"]) for r in result["rows"]] == [
        (*row, batch) for batch in (1, 2) for row in per_batch
    ]
    assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in result["rows"])
    assert result["dtypes"] == ["float32", "auto"] and result["quantization"] == "none"
    assert result["ratios"] == dtype_ratios(result["rows"], ["float32", "auto"])
    assert result["ratios"]["auto"]["resolved_dtype"] == auto
    assert result["ratios"]["float32"]["vs_float32"] == {"1": 1.0, "2": 1.0}
    assert (result["ratio_dtype"], result["ratio_batch"]) == ("auto", 2)
    assert result["ratio_vs_transformers"] == result["ratios"]["auto"]["vs_transformers"]["2"] > 0
    assert {"cpu_model", "cpu_capability", "flags", "native_bf16", "cores", "load_average"} <= set(result["machine"])


def test_smoke_with_one_dtype_has_no_float32_column(tiny_llama_dir: Path):
    result = main(["--smoke", "--model", str(tiny_llama_dir), "--dtypes", "bfloat16", "--batches", "1"])
    assert [(r["engine"], r["resolved_dtype"]) for r in result["rows"]] == [
        ("radixserve", "bfloat16"),
        ("transformers", "float32"),
    ]
    assert set(result["ratios"]["bfloat16"]) == {"resolved_dtype", "vs_transformers", "vs_transformers_cpu_time"}
    assert result["ratio_dtype"] == "bfloat16" and result["ratio_batch"] == 1


def test_smoke_gives_a_row_per_architecture(tmp_path: Path):
    out = tmp_path / "families.json"
    result = main(
        ["--smoke", "--architectures", "qwen3", "gemma3", "--dtypes", "float32", "--batches", "1", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == result
    assert [(r["architecture"], r["dtype"], r["batch"]) for r in result["rows"]] == [
        ("qwen3", "float32", 1),
        ("gemma3", "float32", 1),
    ]
    assert all(r["decode_tok_s"] > 0 and r["transformers_decode_tok_s"] > 0 for r in result["rows"])
    per_arch = result["per_architecture"]
    assert list(per_arch) == ["qwen3", "gemma3"] and per_arch["gemma3"]["model"] == "gemma3"
    assert {"cpu_model", "cores", "load_average"} <= set(result["machine"])


def test_smoke_gives_a_row_per_moe_architecture():
    result = main(["--smoke", "--architectures", "qwen3_moe", "mixtral", "--dtypes", "float32", "--batches", "1"])
    assert [(r["architecture"], r["dtype"], r["batch"]) for r in result["rows"]] == [
        ("qwen3_moe", "float32", 1),
        ("mixtral", "float32", 1),
    ]
    assert all(r["decode_tok_s"] > 0 and r["transformers_decode_tok_s"] > 0 for r in result["rows"])
    assert list(result["per_architecture"]) == ["qwen3_moe", "mixtral"]
