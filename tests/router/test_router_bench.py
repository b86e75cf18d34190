"""benchmarks/router_bench.py --smoke on the session's two tiny replicas (routers started per target)."""

from __future__ import annotations

import pytest

from benchmarks.router_bench import main, parse_target


def test_parse_target():
    assert parse_target("single") == ("single", 1)
    assert parse_target("router=cache_aware:2") == ("cache_aware", 2)
    with pytest.raises(ValueError):
        parse_target("router=fastest:2")


def test_router_bench_smoke(replicas, tiny_llama_dir, tmp_path):
    out = tmp_path / "router.json"
    result = main(
        [
            "--smoke",
            "--model",
            str(tiny_llama_dir),
            "--backends",
            ",".join(r.endpoint for r in replicas),
            "--out",
            str(out),
        ]
    )
    targets = result["targets"]
    assert list(targets) == ["single", "router=cache_aware:2", "router=round_robin:2"]
    for t in targets.values():
        assert t["requests"] == 4 and t["prompt_tokens_agree"] == 4
        assert sum(t["replica_prompt_tokens"]) == t["prompt_tokens"]
    assert targets["router=cache_aware:2"]["cached_tokens"] == targets["single"]["cached_tokens"]
    assert out.exists()
