"""benchmarks/shared_prefix.py --smoke runs (on the tiny random Llama) and counts prefill tokens exactly."""

from __future__ import annotations

import functools
import json

import benchmarks.shared_prefix as shared_prefix
from runtime.engine import Engine


def test_shared_prefix_smoke(tiny_llama_dir, tmp_path, monkeypatch):
    # float32: same_outputs compares the cached run's tokens with the uncached run's (the benchmark has no --dtype)
    monkeypatch.setattr(shared_prefix, "Engine", functools.partial(Engine, dtype="float32"))
    out = tmp_path / "shared_prefix.json"
    report = shared_prefix.main(["--smoke", "--model", str(tiny_llama_dir), "--num-blocks", "64", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    # 4 requests x (32 shared + 8 own) tokens: off computes all 160; on computes the shared 32 once plus 4 x 8
    assert report["off"]["prefill_tokens_computed"] == 160
    assert report["on"]["prefill_tokens_computed"] == 32 + 4 * 8
    assert (report["off"]["hit_rate"], report["on"]["hit_rate"]) == (0.0, 0.6)
    assert report["targets"]["prefill_on_ok"] and report["same_outputs"]
    assert set(report["on"]) >= {"prefill_tokens_computed", "wall_s", "hit_rate", "ttft_p50_s"}
    assert report["speedup"] > 0
