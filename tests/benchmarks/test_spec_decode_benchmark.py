"""benchmarks/spec_decode.py --smoke on the tiny random Llama: a row per setting, workload and concurrency, the
speculative rows give the same tokens as plain decoding, and the counters add up."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.spec_decode import METHODS, main, parse_method


def test_smoke_run(tiny_llama_dir, tmp_path):
    out = tmp_path / "spec.json"
    result = main(["--smoke", "--model", str(tiny_llama_dir), "--dtype", "float32", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    rows = result["rows"]
    keys = [(r["setting"], r["workload"], r["concurrency"]) for r in rows]
    assert keys == [(s, w, c) for s in ("off", "ngram") for w in ("chat", "copy") for c in (1, 2)]
    for r in rows:
        assert r["same_outputs"] is True
        assert r["completion_tokens"] == 2 * 2 * 8  # 2 conversations x 2 turns x 8 tokens (ignore_eos is off:
        # the tiny model never samples its EOS in 8 tokens)
        assert r["decode_tok_s"] > 0 and r["e2e_tok_s"] > 0
        assert r["num_accepted_tokens"] == sum(r["accepted_per_pos"])
        if r["setting"] == "off":
            assert (r["num_drafts"], r["ratio_vs_off"]) == (0, 1.0)
    assert "cpu_model" in result["machine"] or result["machine"]


def test_method_option():
    assert parse_method('ngram8={"method": "ngram", "num_speculative_tokens": 8}') == (
        "ngram8",
        '{"method": "ngram", "num_speculative_tokens": 8}',
    )
    for bad in ("ngram", 'off={"method": "ngram"}', "x=[1]", "x={nope"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_method(bad)
    assert [name for name, _ in METHODS] == ["ngram"]  # off always runs first, outside METHODS
