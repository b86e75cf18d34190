"""benchmarks/qgemv_helper.py --smoke: both small shapes timed with the helper off and on, the same bits either way,
the result written where --out says with the machine facts."""

from __future__ import annotations

import json

import pytest

from benchmarks.qgemv_helper import SMOKE_SHAPES, main


def test_smoke_times_each_shape_off_and_on(tmp_path):
    out = tmp_path / "helper.json"
    result = main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    rows = result["shapes"]["rows"]
    assert list(rows) == list(SMOKE_SHAPES)
    for name, row in rows.items():
        assert (row["n"], row["k"], row["bits"]) == SMOKE_SHAPES[name]
        assert row["off_us"] > 0 and row["on_us"] > 0
        assert row["ratio"] == pytest.approx(row["off_us"] / row["on_us"], rel=1e-2)
        assert row["same_bits"] is True
        assert row["copies"] >= 2
    assert "http" not in result
    assert {"cpu_model", "cores", "load_average"} <= set(result["machine"])
