"""Single-stream decode over HTTP: streamed /v1/completions timed chunk by chunk, alternating between servers
(benchmarks/vs_llama_server.py).

decode tok/s = (tokens - 1) / (last chunk time - first chunk time): the prompt's prefill (TTFT) is not in it. Run
against several servers at once (interleaved), run i goes to the servers in order and run i + 1 in reverse, so a
machine whose speed drifts from minute to minute (a shared VM) slows all of them alike.
"""

from __future__ import annotations

import http.client
import json
import statistics
import time
import urllib.parse
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.chat.config import BenchmarkError


@dataclass
class DecodeRun:
    """One streamed completion: tokens (the server's count), chunks (text chunks received), ttft_s, decode_s
    (last chunk - first chunk, seconds) and decode_tok_s = (tokens - 1) / decode_s."""

    tokens: int
    chunks: int
    ttft_s: float
    decode_s: float
    decode_tok_s: float


def stream_completion(url: str, model: str, prompt: str, max_tokens: int, timeout_s: float = 600.0) -> DecodeRun:
    """POST url/v1/completions {model, prompt, max_tokens, ignore_eos, temperature 0, stream, include_usage}; times the
    chunks as they arrive. tokens: usage.completion_tokens, else llama.cpp's timings.predicted_n, else the chunks.
    Raises BenchmarkError on a non-200 answer or fewer than two chunks."""
    parts = urllib.parse.urlsplit(url)
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout_s)
    times: list[float] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise BenchmarkError(f"{url}/v1/completions: HTTP {resp.status}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            obj = json.loads(line[5:])
            if any(choice.get("text") for choice in obj.get("choices") or []):
                times.append(time.perf_counter())
            usage, timings = obj.get("usage") or usage, obj.get("timings") or timings
    finally:
        conn.close()
    if len(times) < 2:
        raise BenchmarkError(f"{url}/v1/completions: {len(times)} text chunks, need >= 2")
    tokens = int(usage.get("completion_tokens") or timings.get("predicted_n") or len(times))
    decode_s = times[-1] - times[0]
    return DecodeRun(tokens, len(times), round(times[0] - t0, 4), round(decode_s, 4), round((tokens - 1) / decode_s, 2))


def summary(done: list[DecodeRun]) -> dict[str, Any]:
    """The median decode tok/s and TTFT of the runs, whether every chunk held one token, and every run."""
    return {
        "decode_tok_s": round(statistics.median(r.decode_tok_s for r in done), 2),
        "ttft_p50_s": round(statistics.median(r.ttft_s for r in done), 4),
        "one_token_per_chunk": all(r.chunks == r.tokens for r in done),
        "runs": [asdict(r) for r in done],
    }


def interleaved(urls: dict[str, str], model: str, prompt: str, max_tokens: int, runs: int) -> dict[str, dict[str, Any]]:
    """single_stream's result per server name of urls ({name: base URL}), the runs alternating between the servers:
    run i visits them in urls' order for even i, in reverse for odd i. Raises BenchmarkError as stream_completion."""
    done: dict[str, list[DecodeRun]] = {name: [] for name in urls}
    for i in range(runs):
        order = list(urls) if i % 2 == 0 else list(reversed(urls))
        for name in order:
            done[name].append(stream_completion(urls[name], model, prompt, max_tokens))
    return {name: summary(runs_done) for name, runs_done in done.items()}
