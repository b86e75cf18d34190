"""benchmarks/layer_breakdown.py: the hooks time every part of every layer once per step and leave the model as it
was (the same tokens with and without them), and --smoke writes the per-layer split and the profile's top ops."""

from __future__ import annotations

import json
from pathlib import Path

import kernels
from benchmarks.layer_breakdown import PARTS, main, timed_parts
from benchmarks.thread_policy import Decoder


def _decoder(model: str) -> Decoder:
    spec = {"model": model, "batches": [1], "context": 8, "steps": 4, "reps": 1, "threads": [1], "tuned": False}
    return Decoder(spec, dtype="float32", quantization="none")


def test_hooks_count_each_part_and_change_no_token(tiny_llama_dir: Path):
    plain, hooked = _decoder(str(tiny_llama_dir)), _decoder(str(tiny_llama_dir))
    store, attend = kernels.store_kv, kernels.paged_attention
    ids = plain.groups[0]
    want = []
    for _ in range(3):
        plain.step(ids)
        want.append(dict(plain.last))
    got = []
    with timed_parts(hooked.runner.model) as clock:  # the kernel wrappers are global: only hooked steps inside
        for _ in range(3):
            hooked.step(ids)
            got.append(dict(hooked.last))
    assert got == want
    layers = len(hooked.runner.model.layers)
    per_layer = {"layer": 1, "norm": 2, "qkv": 1, "rotary": 1, "store_kv": 1, "attention": 1, "o": 1, "mlp": 1}
    assert dict(clock.calls) == {**{k: 3 * layers * n for k, n in per_layer.items()}, "head": 3 * 2}
    assert (kernels.store_kv, kernels.paged_attention) == (store, attend)  # restored
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in hooked.runner.model.modules())


def test_smoke(tiny_llama_dir: Path, tmp_path: Path):
    out = tmp_path / "lb.json"
    result = main(["--smoke", "--model", str(tiny_llama_dir), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert list(result["per_layer_ms"]) == list(PARTS) and result["layers"] == 2 and result["steps"] == 3
    assert all(result["per_layer_ms"][p] > 0 for p in PARTS if p != "other")
    assert result["calls_per_step"]["qkv"] == 2.0 and result["calls_per_step"]["head"] == 2.0
    assert len(result["top_ops"]) == 15 and all(op["calls"] > 0 for op in result["top_ops"])
