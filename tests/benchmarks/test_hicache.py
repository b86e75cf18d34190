"""benchmarks/hicache.py --smoke on the tiny random Llama: the JSON's keys, the three configurations' counts (the host
tier's hits and prefill equal the unlimited pool's, loads happen, the small pool alone is pressured) and equal greedy
outputs. Speed targets are not asserted (wall-clock)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.hicache import CONFIGS, main

KEYS = {"num_blocks", "hit_rate", "ttft_p50_late_s", "prefill_tokens_computed", "loaded_back_blocks"}


def test_smoke_on_the_tiny_model(tiny_llama_dir: Path, tmp_path: Path):
    out = tmp_path / "hicache.json"
    result = main(["--smoke", "--model", str(tiny_llama_dir), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert set(CONFIGS) | {"outputs_equal"} <= set(result) and result["outputs_equal"] is True
    dev, tier, unl = (result[name] for name in CONFIGS)
    for r in (dev, tier, unl):
        assert KEYS <= set(r)
    assert dev["num_blocks"] == tier["num_blocks"] < unl["num_blocks"]
    assert (tier["hit_rate"], tier["prefill_tokens_computed"]) == (unl["hit_rate"], unl["prefill_tokens_computed"])
    assert tier["loaded_back_blocks"] > 0 == dev["loaded_back_blocks"] == unl["loaded_back_blocks"]
    assert tier["host_cached_tokens"] == 4 * tier["loaded_back_blocks"]  # --smoke: blocks of 4 tokens
    assert dev["hit_rate"] <= 0.6 * unl["hit_rate"] and unl["evicted_blocks"] == 0 < dev["evicted_blocks"]
    met = {name: t["met"] for name, t in result["targets"].items()}
    assert met | {"late_ttft_p50_device_only_over_tier": True} == dict.fromkeys(met, True)
    assert len(result["trace"]["with_host_tier"]) == 9  # 3 chats x 3 turns, in the fixed order
