"""benchmarks/spec_decode.py --smoke on the tiny random Llama (each setting in its own process): a row per setting,
workload and concurrency, the speculative rows give the same tokens as plain decoding, and the counters add up;
--rounds' medians on hand-made rows."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.spec_decode import METHODS, main, parse_method, summarise


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
        assert len(r["ratio_vs_off_rounds"]) == 1
        if r["setting"] == "off":
            assert (r["num_drafts"], r["ratio_vs_off"]) == (0, 1.0)
    assert result["rounds"] == 1
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


def test_bad_rounds_and_setting_are_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--rounds", "0"])
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--only-setting", "nope", "--rows-out", str(tmp_path / "rows.json")])
    assert "--only-setting 'nope' needs --rows-out and a setting among off, ['ngram']" in capsys.readouterr().err
    assert not (tmp_path / "rows.json").exists()


def row(setting: str, decode: float, replies: list[list[int]]) -> dict:
    return {
        "setting": setting,
        "workload": "chat",
        "concurrency": 8,
        "decode_tok_s": decode,
        "e2e_tok_s": decode / 2,
        "decode_tok_per_cpu_s": decode / 4,
        "replies": replies,
    }


def test_rounds_give_medians_of_per_round_ratios():
    # off 100 / 80 / 120, ngram 95 / 96 / 90: ratios 0.95, 1.2, 0.75 -> median 0.95 (not median(ngram) / median(off)).
    rounds = [
        [row("off", 100.0, [[1, 2]]), row("ngram", 95.0, [[1, 2]])],
        [row("off", 80.0, [[1, 2]]), row("ngram", 96.0, [[1, 2]])],
        [row("off", 120.0, [[1, 2]]), row("ngram", 90.0, [[1, 2]])],
    ]
    off, ngram = summarise(rounds)
    assert (off["decode_tok_s"], off["ratio_vs_off"], off["same_outputs"]) == (100.0, 1.0, True)
    assert "replies" not in off
    assert ngram["ratio_vs_off_rounds"] == [0.95, 1.2, 0.75]
    assert (ngram["ratio_vs_off"], ngram["e2e_ratio_vs_off"], ngram["cpu_ratio_vs_off"]) == (0.95, 0.95, 0.95)
    assert (ngram["decode_tok_s"], ngram["e2e_tok_s"]) == (95.0, 47.5)
    assert ngram["same_outputs"] is True
    rounds[2][1]["replies"] = [[1, 3]]  # a round that differs from its off
    assert summarise(rounds)[1]["same_outputs"] is False
    with pytest.raises(ValueError, match="differ"):
        summarise([rounds[0], rounds[1][::-1]])
