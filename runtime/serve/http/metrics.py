"""HttpMetrics: what GET /metrics exposes, in the Prometheus text format (prometheus_client), names in vLLM's style.

Every series is under the `radixserve:` prefix with a `model_name` label (the served model name). Two sources:

- The backend's ServerStats, fetched by the app when /metrics is scraped (never a cached snapshot) and passed to
  render(): the counters prefix_cache_queries_total / prefix_cache_hits_total (prompt tokens looked up in / found in
  the radix cache, each request counted once, at its first admission), prompt_tokens_total, generation_tokens_total
  (sampled completion tokens, stop-string trimming not subtracted), num_preemptions_total, evicted_blocks_total,
  speculative decoding's spec_decode_num_drafts_total / _num_draft_tokens_total / _num_accepted_tokens_total and
  spec_decode_num_accepted_tokens_per_pos_total{position} (vLLM's names; 0 and no position when it is off), and
  the gauges num_requests_running / num_requests_waiting (sequences: a request with n > 1 counts n),
  kv_cache_usage_perc (used KV blocks / usable blocks, 0..1, as vLLM's) and cached_blocks (blocks in the radix
  tree). A prometheus Counter cannot be set, so these come from a custom collector that reads the stats given to
  render(). They count every client of the backend, ZeroMQ ones too.
- The completions this HTTP server served, reported by the app through observe(): request_success_total (label
  finish_reason) and the histograms time_to_first_token_seconds, inter_token_latency_seconds,
  e2e_request_latency_seconds and request_queue_time_seconds (seconds; queue time as the scheduler measured it,
  Usage.queue_time_s).

The histograms are kept here (bucket counts and a sum per histogram) rather than as prometheus_client Histogram
objects, so the exposition carries no `_created` series and the module keeps no global state. Thread-safe.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from runtime.protocol import ServerStats

CONTENT_TYPE = CONTENT_TYPE_LATEST  # the Content-Type of render()'s bytes
PREFIX = "radixserve:"

# Bucket upper bounds in seconds (the +Inf bucket is implied): TTFT and ITL from 1 ms (a GPU decode step) up; e2e and
# queue time up to the hour.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    80.0,
)
E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    3600.0,
)
QUEUE_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    3600.0,
)

# (name without the prefix and the _total suffix, ServerStats field, help)
COUNTERS = (
    ("prefix_cache_queries", "prompt_tokens", "Prompt tokens looked up in the prefix cache (each request once)."),
    ("prefix_cache_hits", "cached_tokens", "Prompt tokens found in the prefix cache (their KV was reused)."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of the requests admitted."),
    ("generation_tokens", "generated_tokens", "Completion tokens sampled."),
    ("num_preemptions", "num_preemptions", "Sequences preempted (recompute or swap)."),
    ("evicted_blocks", "num_evicted_blocks", "Cached KV blocks evicted from the radix tree to make room."),
    (
        "window_evicted_blocks",
        "num_window_evicted_blocks",
        "Cached sliding-window KV blocks evicted to make room (0 with one KV cache group).",
    ),
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Speculative drafts verified (one per sequence and step)."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Speculative draft tokens proposed."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."),
)
GAUGES = (
    ("num_requests_running", "num_running", "Sequences in the running batch."),
    ("num_requests_waiting", "num_waiting", "Sequences waiting for admission."),
    ("kv_cache_usage_perc", "kv_usage", "KV cache usage: used blocks / usable blocks (1 means 100 percent)."),
    ("cached_blocks", "num_cached_blocks", "KV blocks in the radix tree (evictable or in use)."),
    ("window_used_blocks", "num_window_used_blocks", "Sliding-window KV blocks listed by a sequence (0: one group)."),
    ("window_cached_blocks", "num_window_cached_blocks", "Sliding-window KV blocks held by radix tree nodes."),
)
FINISH_REASONS = ("stop", "length")  # always exposed (0 until seen); others appear when the first one is observed


class _Histogram:
    """Cumulative-bucket histogram of one label set: counts per upper bound (+Inf last) and the sum of values."""

    def __init__(self, name: str, help: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.help = help
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """O(log buckets). A value equal to a bound falls in that bound's bucket (le is inclusive)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, model_name: str) -> HistogramMetricFamily:
        cumulative = []
        total = 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += count
            cumulative.append((bound, total))
        family = HistogramMetricFamily(PREFIX + self.name, self.help, labels=["model_name"])
        family.add_metric([model_name], cumulative, sum_value=self.sum)
        return family


class HttpMetrics:
    """The /metrics state of one HTTP server: its own CollectorRegistry (nothing global), the histograms and
    request_success counts it observed, and the ServerStats of the current scrape.

    observe() is called by the app once per finished completion it served; render(stats) returns the exposition.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self._stats: ServerStats | None = None
        self._success = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = _Histogram("time_to_first_token_seconds", "Time to first token (s).", TTFT_BUCKETS)
        self.itl = _Histogram("inter_token_latency_seconds", "Time between consecutive output tokens (s).", ITL_BUCKETS)
        self.e2e = _Histogram("e2e_request_latency_seconds", "Request latency, arrival to last token (s).", E2E_BUCKETS)
        self.queue = _Histogram(
            "request_queue_time_seconds",
            "Time from arrival at the scheduler to the first admission (s).",
            QUEUE_BUCKETS,
        )
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def observe(
        self, finish_reason: str, ttft_s: float | None, itl_s: Iterable[float], e2e_s: float, queue_s: float | None
    ) -> None:
        """Counts one finished completion: request_success_total{finish_reason} += 1 and one observation per
        histogram (ttft_s / queue_s None: not observed; itl_s: every gap between consecutive output tokens, so a
        completion of k tokens gives k - 1 values). Seconds throughout. O(len(itl_s) * log buckets)."""
        with self._lock:
            self._success[finish_reason] = self._success.get(finish_reason, 0) + 1
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            for gap in itl_s:
                self.itl.observe(gap)
            self.e2e.observe(e2e_s)
            if queue_s is not None:
                self.queue.observe(queue_s)

    def render(self, stats: ServerStats | None) -> bytes:
        """The Prometheus text exposition (Content-Type CONTENT_TYPE) with the backend series read from stats (the
        backend's answer at this scrape); stats None (backend unreachable) leaves the backend series out."""
        with self._lock:
            self._stats = stats
            try:
                return generate_latest(self.registry)
            finally:
                self._stats = None

    def collect(self) -> Iterator[Metric]:
        """Every metric family (the registry's collector; call under the lock, as render() does)."""
        labels = [self.model_name]
        s = self._stats
        if s is not None:
            for name, field, help in COUNTERS:
                counter = CounterMetricFamily(PREFIX + name, help, labels=["model_name"])
                counter.add_metric(labels, getattr(s, field))
                yield counter
            yield _accepted_per_pos(s, labels)
            for name, field, help in GAUGES:
                gauge = GaugeMetricFamily(PREFIX + name, help, labels=["model_name"])
                gauge.add_metric(labels, getattr(s, field))
                yield gauge
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Completions served over HTTP, by finish reason.",
            labels=["model_name", "finish_reason"],
        )
        for reason, count in self._success.items():
            success.add_metric([self.model_name, reason], count)
        yield success
        for hist in (self.ttft, self.itl, self.e2e, self.queue):
            yield hist.family(self.model_name)


def _accepted_per_pos(stats: ServerStats, labels: list[str]) -> CounterMetricFamily:
    """spec_decode_num_accepted_tokens_per_pos_total{position}: drafts whose token at position (0-based) stood."""
    family = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Speculative drafts whose token at this position was accepted.",
        labels=["model_name", "position"],
    )
    for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
        family.add_metric([*labels, str(position)], count)
    return family


class _Collector:
    """Adapts HttpMetrics to prometheus_client's Collector protocol."""

    def __init__(self, metrics: HttpMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.collect()
