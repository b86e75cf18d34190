"""The idle TTFT comparison of benchmarks/http_load.py: one short streamed request at a time through the ZeroMQ
AsyncClient, the HTTP API through the openai SDK and the HTTP API through a bare http.client connection."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from typing import Any

from benchmarks.load.outcome import pct


async def idle_ttft(endpoint: str, url: str, model: str, n: int) -> dict[str, Any]:
    """n streamed requests of one short prompt through each path, alternating, one at a time, each read to its end;
    TTFT in seconds (to the first chunk with tokens / with content or a finish reason; raw: the first SSE event
    with a choice, as the server sends none before the first token)."""
    from openai import AsyncOpenAI

    from runtime.client import AsyncClient

    messages: list[Any] = [{"role": "user", "content": "Say hello."}]
    zmq_s: list[float] = []
    http_s: list[float] = []
    raw_s: list[float] = []
    loop = asyncio.get_running_loop()
    async with (
        AsyncClient(endpoint, timeout=300.0) as zc,
        AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=300.0, max_retries=0) as hc,
    ):
        for i in range(n + 1):  # the first round warms both paths up and is not counted
            t0 = time.perf_counter()
            first = None
            async for chunk in zc.stream(messages=messages, max_tokens=2, temperature=0.0):
                if first is None and (chunk.token_ids or chunk.finish_reason is not None):
                    first = time.perf_counter() - t0
            if i and first is not None:
                zmq_s.append(first)
            t0 = time.perf_counter()
            first = None
            stream = await hc.chat.completions.create(
                model=model, messages=messages, max_tokens=2, temperature=0.0, stream=True
            )
            async for hchunk in stream:
                if first is None and any(c.delta.content or c.finish_reason for c in hchunk.choices):
                    first = time.perf_counter() - t0
            if i and first is not None:
                http_s.append(first)
            first = await loop.run_in_executor(None, raw_ttft, url, model, messages)
            if i and first is not None:
                raw_s.append(first)
    z50 = pct(zmq_s, 50)
    h50 = pct(http_s, 50)
    r50 = pct(raw_s, 50)

    def diff_ms(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round((a - b) * 1e3, 2)

    return {
        "requests_each": n,
        "zmq_ttft_p50_s": z50,
        "http_ttft_p50_s": h50,
        "raw_http_ttft_p50_s": r50,
        "http_minus_zmq_p50_ms": diff_ms(h50, z50),
        "raw_http_minus_zmq_p50_ms": diff_ms(r50, z50),
    }


def raw_ttft(url: str, model: str, messages: list[Any]) -> float | None:
    """TTFT (s) of one streamed chat request over a fresh http.client connection: to the first SSE line carrying a
    choice (the server sends its first event with the first token). Reads the stream to its end."""
    host, _, port = url.removeprefix("http://").rpartition(":")
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=300)
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 2, "temperature": 0.0, "stream": True})
    t0 = time.perf_counter()
    first = None
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        for line in conn.getresponse():
            if first is None and line.startswith(b"data: {") and b'"choices":[{' in line:
                first = time.perf_counter() - t0
    finally:
        conn.close()
    return first
