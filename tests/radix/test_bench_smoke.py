"""benchmarks/radix_ops.py --smoke runs every code path of the benchmark, so the script never rots."""

from __future__ import annotations

import json

import pytest

from benchmarks import radix_ops

pytestmark = pytest.mark.slow  # seconds per test: make test-fast leaves it out


def test_radix_ops_smoke(tmp_path):
    out = tmp_path / "radix_ops.json"
    result = radix_ops.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["tree_blocks"] == [1_000, 4_000]
    assert sorted(result["us_per_block"]) == ["evict", "insert", "match"]
    assert all(len(v) == 2 for v in result["us_per_block"].values())
    # the pool holds the whole trace: the tree finds everything the trace can reuse
    assert result["hit_rate"] == result["oracle_hit_rate"] == 17 / 21
    assert 0 < result["bytes_per_cached_block"]


def test_oracle_hit_rate_by_hand():
    trace = radix_ops.make_trace(conversations=2, turns=2)
    # turn prompts: 640 and 896 tokens; reusable: conv 0: 0 then 768, conv 1: 512 (system prompt) then 768
    assert radix_ops.oracle_hit_rate(trace) == (0 + 768 + 512 + 768) / (640 + 896 + 640 + 896)
