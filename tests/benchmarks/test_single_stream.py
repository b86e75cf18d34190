"""Tests of benchmarks/chat/single_stream.py: the order of interleaved runs and the summary of each server's runs
(stream_completion replaced by a recorder: the HTTP side is covered by test_vs_llama_server.py's --smoke run)."""

from __future__ import annotations

import pytest

from benchmarks.chat import single_stream
from benchmarks.chat.single_stream import DecodeRun, interleaved


def test_interleaved_alternates_servers_and_summarizes_each(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    speed = {"http://a": 10.0, "http://b": 40.0}

    def fake(url: str, model: str, prompt: str, max_tokens: int) -> DecodeRun:
        calls.append(url)
        n = len(calls)
        return DecodeRun(max_tokens, max_tokens, 0.01 * n, 1.0, speed[url] + n)

    monkeypatch.setattr(single_stream, "stream_completion", fake)
    out = interleaved({"ours": "http://a", "theirs": "http://b"}, "m", "p", 8, 3)
    assert calls == ["http://a", "http://b", "http://b", "http://a", "http://a", "http://b"]
    assert [r["decode_tok_s"] for r in out["ours"]["runs"]] == [11.0, 14.0, 15.0]
    assert [r["decode_tok_s"] for r in out["theirs"]["runs"]] == [42.0, 43.0, 46.0]
    assert out["ours"]["decode_tok_s"] == 14.0
    assert out["theirs"]["decode_tok_s"] == 43.0
    assert out["ours"]["ttft_p50_s"] == 0.04
    assert out["ours"]["one_token_per_chunk"] is True
