"""GET /metrics: HttpMetrics' exposition on its own (exact values), then a real server behind the HTTP API, whose
counters move by exactly the tokens of a known request (the openai SDK is the client)."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.protocol import ServerStats
from runtime.serve.http.metrics import CONTENT_TYPE, HttpMetrics
from tests.e2e.servers import TINY_FLAGS
from tests.paths import ROOT

BACKEND_SERIES = {  # name -> ServerStats field
    "radixserve:prefix_cache_queries_total": "prompt_tokens",
    "radixserve:prefix_cache_hits_total": "cached_tokens",
    "radixserve:prompt_tokens_total": "prompt_tokens",
    "radixserve:generation_tokens_total": "generated_tokens",
    "radixserve:num_preemptions_total": "num_preemptions",
    "radixserve:evicted_blocks_total": "num_evicted_blocks",
    "radixserve:num_requests_running": "num_running",
    "radixserve:num_requests_waiting": "num_waiting",
    "radixserve:kv_cache_usage_perc": "kv_usage",
    "radixserve:cached_blocks": "num_cached_blocks",
}
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
)


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus exposition: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"duplicate sample {key}"
            out[key] = s.value
    return out


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_name": "m", **labels}.items())))]


def test_backend_series_are_read_from_the_stats_of_the_scrape():
    metrics = HttpMetrics("m")
    stats = ServerStats(
        prompt_tokens=120,
        cached_tokens=48,
        generated_tokens=33,
        num_preemptions=2,
        num_evicted_blocks=7,
        num_running=3,
        num_waiting=5,
        kv_usage=0.375,
        num_cached_blocks=11,
    )
    samples = parse(metrics.render(stats).decode())
    assert {name: sample(samples, name) for name in BACKEND_SERIES} == {
        name: float(getattr(stats, field)) for name, field in BACKEND_SERIES.items()
    }
    later = parse(metrics.render(ServerStats(prompt_tokens=130, num_running=0)).decode())  # nothing is kept
    assert sample(later, "radixserve:prompt_tokens_total") == 130.0
    assert sample(later, "radixserve:num_requests_running") == 0.0
    assert sample(later, "radixserve:prefix_cache_hits_total") == 0.0
    assert CONTENT_TYPE.startswith("text/plain; version=")


def test_without_stats_only_the_http_series_are_exposed():
    samples = parse(HttpMetrics("m").render(None).decode())
    names = {name for name, _labels in samples}
    assert not names & set(BACKEND_SERIES)
    assert {"radixserve:request_success_total"} | {f"radixserve:{h}_count" for h in HISTOGRAMS} <= names
    assert sample(samples, "radixserve:request_success_total", finish_reason="stop") == 0.0
    assert sample(samples, "radixserve:request_success_total", finish_reason="length") == 0.0


def test_observe_counts_completions_by_finish_reason_and_fills_the_histograms():
    metrics = HttpMetrics("m")
    metrics.observe("stop", 0.02, [0.01, 0.01, 0.2], 0.5, 0.003)
    metrics.observe("length", None, [], 1.5, None)  # no first token, no queue time known
    metrics.observe("abort", 0.3, [0.05], 2.0, 0.0)
    samples = parse(metrics.render(ServerStats()).decode())
    success = {
        reason: sample(samples, "radixserve:request_success_total", finish_reason=reason)
        for reason in ("stop", "length", "abort")
    }
    assert success == {"stop": 1.0, "length": 1.0, "abort": 1.0}
    counts = {h: sample(samples, f"radixserve:{h}_count") for h in HISTOGRAMS}
    assert counts == {
        "time_to_first_token_seconds": 2.0,
        "inter_token_latency_seconds": 4.0,
        "e2e_request_latency_seconds": 3.0,
        "request_queue_time_seconds": 2.0,
    }
    assert sample(samples, "radixserve:e2e_request_latency_seconds_sum") == 4.0
    assert math.isclose(sample(samples, "radixserve:inter_token_latency_seconds_sum"), 0.27)
    itl = "radixserve:inter_token_latency_seconds_bucket"
    assert [sample(samples, itl, le=le) for le in ("0.005", "0.01", "0.05", "0.2", "0.3", "+Inf")] == [
        0.0,
        2.0,
        3.0,
        4.0,
        4.0,
        4.0,
    ]  # le is inclusive: 0.01 counts in le="0.01"
    ttft = "radixserve:time_to_first_token_seconds_bucket"
    assert [sample(samples, ttft, le=le) for le in ("0.01", "0.02", "0.25", "0.5")] == [0.0, 1.0, 1.0, 2.0]
    assert not any(name.endswith("_created") for name, _labels in samples)


def test_every_series_carries_the_model_name():
    metrics = HttpMetrics("my-model")
    metrics.observe("stop", 0.1, [0.1], 0.2, 0.0)
    for family in text_string_to_metric_families(metrics.render(ServerStats()).decode()):
        assert family.name.startswith("radixserve:")
        for s in family.samples:
            assert s.labels["model_name"] == "my-model", s


@pytest.mark.parametrize(
    "name", list(BACKEND_SERIES) + ["radixserve:request_success_total"] + [f"radixserve:{h}" for h in HISTOGRAMS]
)
def test_every_series_is_documented_in_the_readme(name):

    readme = (ROOT / "README.md").read_text()
    assert f"`{name.removeprefix('radixserve:')}`" in readme, name


# ------------------------------------------------------------------------------------------- through a real server
@pytest.fixture(scope="module")
def http_server(tiny_llama_dir, tmp_path_factory):
    from tests.e2e.http_servers import start_http_server

    server = start_http_server(
        str(tiny_llama_dir),
        tmp_path_factory.mktemp("logs") / "http_metrics.log",
        *TINY_FLAGS,
        "--served-model-name",
        "m",
    )
    yield server
    server.stop()


def _delta(after: dict, before: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": "m", **labels}.items())))
    return after[key] - before.get(key, 0.0)


def test_counters_move_by_exactly_the_tokens_of_a_request(http_server):
    from openai import OpenAI

    from tests.e2e.http_servers import scrape

    client = OpenAI(base_url=http_server.url + "/v1", api_key="none", max_retries=0)
    prompt = [(7 * i) % 5000 + 100 for i in range(40)]  # 40 token ids: 2 full blocks of 16 cached after the first
    before = scrape(http_server.url)
    first = client.completions.create(
        model="m", prompt=prompt, max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True}
    )
    mid = scrape(http_server.url)
    stream = client.completions.create(
        model="m",
        prompt=prompt,
        max_tokens=6,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    after = scrape(http_server.url)
    second = chunks[-1].usage
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (40, 5)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert (second.prompt_tokens, second.completion_tokens, second.prompt_tokens_details.cached_tokens) == (40, 6, 32)
    for hi, lo, usage in ((mid, before, first.usage), (after, mid, second)):
        assert _delta(hi, lo, "radixserve:prompt_tokens_total") == usage.prompt_tokens
        assert _delta(hi, lo, "radixserve:prefix_cache_queries_total") == usage.prompt_tokens
        assert _delta(hi, lo, "radixserve:generation_tokens_total") == usage.completion_tokens
        assert _delta(hi, lo, "radixserve:prefix_cache_hits_total") == usage.prompt_tokens_details.cached_tokens
        assert _delta(hi, lo, "radixserve:request_success_total", finish_reason="length") == 1
        for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
            assert _delta(hi, lo, f"radixserve:{h}_count") == 1, h
        # one gap per token-bearing chunk after the first; without stop strings each decode step's one token is
        # its own chunk, so exactly completion_tokens - 1 gaps
        assert _delta(hi, lo, "radixserve:inter_token_latency_seconds_count") == usage.completion_tokens - 1
    for s in (before, mid, after):
        hits = s[("radixserve:prefix_cache_hits_total", (("model_name", "m"),))]
        assert hits <= s[("radixserve:prefix_cache_queries_total", (("model_name", "m"),))]
    assert after[("radixserve:num_requests_running", (("model_name", "m"),))] == 0
    assert after[("radixserve:cached_blocks", (("model_name", "m"),))] >= 2
