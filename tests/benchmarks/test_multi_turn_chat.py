"""Tests of benchmarks/multi_turn_chat.py: the trace analysis on hand-made traces (exact values), the OpenAI-style
client against a local stub, and one --smoke run of every target on the tiny random Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.chat.config import BenchmarkError
from benchmarks.chat.openai_client import openai_request
from benchmarks.chat.trace import Record, Reply, first_mismatches, oracle_cached
from benchmarks.chat.workload import build_workload
from benchmarks.multi_turn_chat import main, parse_targets
from tests.benchmarks.openai_stub import OpenAIStub


def _rec(conv: int, turn: int, t_submit: float, t_end: float, prompt: list[int], output: list[int]) -> Record:
    reply = Reply(t_submit + 0.1, t_end, output, "", "length", len(prompt), 0)
    return Record(conv, turn, t_submit, [], reply, prompt_ids=prompt)


def test_oracle_counts_whole_blocks_of_finished_requests_only():
    a = list(range(100, 140))  # 40 tokens
    records = [
        _rec(0, 1, 0.0, 1.0, a[:20], a[20:30]),  # finished at 1.0 with prompt + output = a[:30]
        _rec(0, 2, 2.0, 3.0, a[:37], []),  # 30 tokens match -> 28 in blocks of 4
        _rec(1, 1, 0.5, 4.0, a[:37], []),  # sent before anything finished -> 0
        _rec(2, 1, 5.0, 6.0, a[:8], []),  # the whole prompt matches: capped at len - 1 = 7 -> 4
        _rec(3, 1, 5.0, 6.0, [7] + a[1:20], []),  # differs at 0 -> 0
    ]
    assert oracle_cached(records, block_size=4) == [0, 28, 0, 4, 0]
    # with in-flight prompts: (1, 1) sent at 0.5 may reuse the prompt a[:20] of (0, 1), in flight since 0.0
    assert oracle_cached(records, block_size=4, include_inflight=True) == [0, 36, 20, 4, 0]


def test_first_mismatch_against_previous_prompt_and_output():
    records = [
        _rec(0, 1, 0.0, 1.0, [1, 2, 3], [4, 5]),
        _rec(0, 2, 2.0, 3.0, [1, 2, 3, 4, 5, 6, 7], [8]),  # equal over the shorter length
        _rec(0, 3, 4.0, 5.0, [1, 2, 3, 4, 9, 6, 7, 8], []),  # differs at index 4
        _rec(1, 1, 0.0, 1.0, [1], [2]),
    ]
    assert first_mismatches(records) == {(0, 2): None, (0, 3): 4}


def test_parse_targets():
    assert parse_targets(None) == ["radixserve", "radixserve-nocache"]
    assert parse_targets(["engine,transformers", "openai=http://127.0.0.1:8080", "radixserve-http"]) == [
        "engine",
        "transformers",
        "openai=http://127.0.0.1:8080",
        "radixserve-http",
    ]
    with pytest.raises(BenchmarkError, match="unknown target 'vllm'"):
        parse_targets(["vllm"])
    assert parse_targets(["router=cache_aware:2", "router=round_robin:2"]) == [
        "router=cache_aware:2",
        "router=round_robin:2",
    ]
    with pytest.raises(BenchmarkError, match="bad target 'router=fastest:2'"):
        parse_targets(["router=fastest:2"])
    with pytest.raises(BenchmarkError, match="bad target 'router=cache_aware:0'"):
        parse_targets(["router=cache_aware:0"])


def test_workload_is_seeded_readable_and_sized(smollm2_tokenizer):
    a = build_workload(smollm2_tokenizer, 3, 2, 64, 20, 30, seed=5)
    b = build_workload(smollm2_tokenizer, 3, 2, 64, 20, 30, seed=5)
    assert a == b
    assert len(smollm2_tokenizer.encode(a.system_prompt, add_special_tokens=False)) == 64
    assert a.system_prompt.startswith("You are the help desk assistant of the Northgate Public Library.")
    for row, sizes in zip(a.user_turns, a.user_tokens, strict=True):
        for text, size in zip(row, sizes, strict=True):
            assert 20 <= size <= 30 and text.endswith("?")
            assert abs(len(smollm2_tokenizer.encode(text, add_special_tokens=False)) - size) <= 2


def test_openai_request_reads_usage_and_llamacpp_timings(smollm2_tokenizer):
    stub = OpenAIStub(smollm2_tokenizer)
    url = stub.start()
    try:
        messages = [{"role": "system", "content": "Be brief. " * 20}, {"role": "user", "content": "Hours?"}]
        first = openai_request(url, "m", messages, max_tokens=5)
        again = openai_request(url + "/llamacpp", "m", messages, max_tokens=5)
    finally:
        stub.stop()
    prompt_len = stub.requests[0][0]
    assert (first.prompt_tokens, first.cached_tokens, first.text) == (prompt_len, 0, stub.requests[0][2])
    assert (again.prompt_tokens, again.cached_tokens) == (prompt_len, (prompt_len - 1) // 16 * 16)
    assert first.finish_reason == "length" and first.t_first is not None
    completion = len(smollm2_tokenizer.encode(stub.requests[0][2], add_special_tokens=False))
    assert first.completion_tokens == again.completion_tokens == completion  # usage's, then timings.predicted_n


def test_openai_target_refuses_remote_hosts():
    with pytest.raises(BenchmarkError, match="only servers on 127.0.0.1"):
        parse_targets(["radixserve,openai=http://10.0.0.1:8080"])
    assert parse_targets(["openai=http://localhost:8080/v1"]) == ["openai=http://localhost:8080/v1"]


def test_smoke_every_target_on_the_tiny_model(tiny_llama_dir: Path, smollm2_tokenizer, tmp_path: Path):
    stubs = [OpenAIStub(smollm2_tokenizer), OpenAIStub(smollm2_tokenizer)]  # one cache per target
    urls = [stub.start() for stub in stubs]
    out = tmp_path / "chat.json"
    targets = (
        f"radixserve,radixserve-nocache,radixserve-http,engine,transformers,openai={urls[0]},openai={urls[1]}/llamacpp"
    )
    try:
        result = main(["--smoke", "--model", str(tiny_llama_dir), "--target", targets, "--out", str(out)])
    finally:
        for stub in stubs:
            stub.stop()
    assert json.loads(out.read_text()) == result
    assert out.with_suffix(".png").stat().st_size > 0
    t = result["targets"]
    assert list(t) == targets.split(",")
    for name, s in t.items():
        assert s["requests"] == 4 and [p["turn"] for p in s["per_turn"]] == [1, 2]
        assert s["prompt_tokens_agree"] == 4, name  # same chat template and tokenizer as the benchmark
        trace = sorted(s["trace"])
        assert trace[0][3] == 0  # the very first request has nothing to hit
        for conv, turn, _prompt, cached, oracle, completion, _reason in trace:
            assert completion == 4, name
            if name in ("radixserve-nocache", "transformers"):
                assert cached == 0
            elif name == "radixserve-http":
                continue  # its oracle is over re-tokenized replies: compared with radixserve's trace below
            elif name.startswith("openai="):
                assert cached == oracle  # the stub caches exactly what the oracle counts (concurrency 1)
            else:  # the server never has the KV of the last sampled token: at most one block below the oracle
                assert oracle - 16 <= cached <= oracle, (name, conv, turn)
    for name in ("radixserve", "engine"):
        assert t[name]["hit_rate"] > 0
    # the same greedy server behind HTTP (concurrency 1): the same prompts, cache hits, completion tokens and reasons
    zmq, http = ([row[:4] + row[5:] for row in sorted(t[name]["trace"])] for name in ("radixserve", "radixserve-http"))
    assert zmq == http
    assert set(result["targets_met"]) == {
        "radixserve_hit_rate_over_oracle",
        "engine_hit_rate_over_oracle",
        "radixserve_hit_rate_over_inflight_oracle",
        "engine_hit_rate_over_inflight_oracle",
        "ttft_turn2plus_speedup",
        "output_tok_per_s_on_over_off",
        "http_output_tok_per_s_over_zmq",
        "http_ttft_p50_minus_zmq_s",
    }
    for name, s in t.items():  # concurrency 1: nothing is in flight when a request is sent, the two oracles agree
        assert s["oracle_inflight_hit_rate"] == s["oracle_hit_rate"], name
    assert len(result["config"]["workload"]["user_turns"]) == 2 and result["config"]["concurrency"] == 1


def test_radixserve_http_through_the_stdlib_client_with_a_dtype(tiny_llama_dir: Path):
    result = main(
        [
            "--smoke",
            "--model",
            str(tiny_llama_dir),
            "--target",
            "radixserve,radixserve-http",
            "--http-client",
            "stdlib",
            "--dtype",
            "float32",
        ]
    )
    config = result["config"]
    assert (config["http_client"], config["dtype"], config["quantization"]) == ("stdlib", "float32", "none")
    zmq, http = (
        [row[:4] + row[5:] for row in sorted(result["targets"][name]["trace"])]
        for name in ("radixserve", "radixserve-http")
    )
    assert zmq == http  # greedy, concurrency 1: the same prompts, hits, completion tokens and reasons either way
    assert result["targets"]["radixserve-http"]["prompt_tokens_agree"] == 4
