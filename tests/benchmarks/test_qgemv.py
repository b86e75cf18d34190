"""benchmarks/qgemv.py: the smoke run measures every method on both activation dtypes and both legs (the AVX2 leg in a
subprocess with torch held to AVX2), and the crossing rule on hand-made rows."""

from __future__ import annotations

import pytest
import torch

from benchmarks.qgemv import METHODS, crossings, crossings_torch, main, weight_bytes
from kernels import cpu_qgemv


def test_crossing_is_the_largest_row_count_up_to_which_a_method_beats_dense_everywhere():
    def row(shape: str, m: int, method: str, us: float) -> dict:
        return {"shape": shape, "dtype": "float32", "rows": m, "method": method, "us": us}

    rows = [row(s, m, "dense", 10.0) for s in ("a", "b") for m in (1, 2, 4)]
    rows += [row("a", 1, "qgemv_int4", 5.0), row("a", 2, "qgemv_int4", 9.0), row("a", 4, "qgemv_int4", 11.0)]
    rows += [row("b", 1, "qgemv_int4", 5.0), row("b", 2, "qgemv_int4", 12.0), row("b", 4, "qgemv_int4", 5.0)]
    for method in METHODS[1:-1]:
        rows += [row(s, m, method, 20.0) for s in ("a", "b") for m in (1, 2, 4)]
    got = crossings(rows)
    assert got == {"float32": {"qgemv_int4": 1, "qgemv_int8": 0, "torch_int4": 0, "torch_int8": 0}}
    assert weight_bytes("qgemv_int4", 64, 64, torch.float32) == 64 * 32 + 64 * 2 * 8


def test_torch_crossing_is_the_largest_row_count_up_to_which_the_op_beats_torch_everywhere():
    def row(shape: str, m: int, method: str, us: float) -> dict:
        return {"shape": shape, "dtype": "bfloat16", "rows": m, "method": method, "us": us}

    rows = [row(s, m, "torch_int4", 10.0) for s in ("a", "b") for m in (1, 2, 4)]
    rows += [row(s, m, "torch_int8", 10.0) for s in ("a", "b") for m in (1, 2, 4)]
    rows += [row("a", 1, "qgemv_int4", 9.0), row("a", 2, "qgemv_int4", 9.5), row("a", 4, "qgemv_int4", 9.0)]
    rows += [row("b", 1, "qgemv_int4", 5.0), row("b", 2, "qgemv_int4", 10.0), row("b", 4, "qgemv_int4", 5.0)]
    rows += [row(s, m, "qgemv_int8", 11.0) for s in ("a", "b") for m in (1, 2, 4)]
    assert crossings_torch(rows) == {"bfloat16": {"qgemv_int4": 1, "qgemv_int8": 0}}  # 10.0 is no win at b, 2 rows


@pytest.mark.slow  # two processes that each import torch and quantize 30 copies per shape: ~30 s on 2 loaded cores
def test_smoke_run_measures_every_method_on_both_legs(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_qgemv, "ENABLED", cpu_qgemv.ENABLED)  # main() turns the op on: undone after
    out = tmp_path / "qgemv.json"
    result = main(["--smoke", "--legs", "native", "avx2", "--out", str(out)])
    assert out.exists()
    avx2 = result["legs"]["avx2"]
    assert avx2["isa"] == "avx2" and avx2["machine"]["cpu_capability"] == "AVX2"
    assert not any(f.startswith("avx512") for f in avx2["machine"]["flags"])
    for leg in result["legs"].values():
        measured = {(r["shape"], r["dtype"], r["rows"], r["method"]) for r in leg["rows"]}
        assert len(measured) == 2 * 2 * 2 * len(METHODS) == len(leg["rows"])
        assert all(r["us"] > 0 and r["gb_s"] > 0 for r in leg["rows"])
        assert leg["machine"]["load_average"] is not None
        assert set(leg["crossing"]) == {"dense", "torch"}
        assert set(leg["crossing"]["torch"]["float32"]) == {"qgemv_int4", "qgemv_int8"}
