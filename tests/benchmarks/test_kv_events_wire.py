"""benchmarks/kv_events_wire.py --smoke: the JSON's rows, and each format's growth per block exactly as the formats
say (vLLM's: a 64-bit int hash, 9 bytes in msgpack, 16 token ids of 3 bytes each and a nil extra_keys entry, 1;
ours: a 16-byte bin, 18)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.kv_events_wire import main


def test_smoke(tmp_path: Path):
    out = tmp_path / "kv_events_wire.json"
    result = main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["mode"] == "smoke" and "cpu_model" in result["machine"]
    one, twelve = result["wire"]
    assert (one["blocks"], twelve["blocks"]) == (1, 12)
    assert twelve["vllm_bytes"] - one["vllm_bytes"] == 11 * (9 + 16 * 3 + 1)
    assert twelve["own_bytes"] - one["own_bytes"] == 11 * 18
    assert all(row["vllm_us"] > 0 and row["own_us"] > 0 for row in result["wire"])
    assert [row["blocks"] for row in result["manager"]] == [1, 12]
