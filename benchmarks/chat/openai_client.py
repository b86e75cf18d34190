"""The client of OpenAI-compatible chat completions servers on 127.0.0.1 (llama.cpp's llama-server, or our own HTTP
server with --http-client stdlib): one streamed request over http.client, and the conversations driven through it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import time
import urllib.parse
from typing import Any

from benchmarks.chat.config import BenchmarkError, Config
from benchmarks.chat.drive import drive_async
from benchmarks.chat.trace import Record, Reply
from benchmarks.chat.workload import ChatWorkload


def openai_request(
    url: str, model: str, messages: list[dict[str, str]], max_tokens: int, timeout_s: float = 600.0
) -> Reply:
    """One streaming POST to an OpenAI-compatible chat completions URL; reads text deltas, usage and llama.cpp
    timings (completion_tokens: usage's, else timings.predicted_n). output_ids are left empty (the caller
    re-tokenizes the text). The body has OpenAI fields only, so our server takes it too; llama-server's prompt cache
    is on without asking (cache_prompt defaults to true, tools/server/server-task.h of b11434). Raises
    BenchmarkError on a non-200."""
    parts = urllib.parse.urlsplit(url)
    path = parts.path.rstrip("/")
    path = path if path.endswith("/chat/completions") else f"{path or ''}/v1/chat/completions"
    body = json.dumps(
        {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    first = None
    text = ""
    usage = None
    timings = None
    reason = None
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise BenchmarkError(f"{url}: HTTP {resp.status}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            for choice in obj.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content") or ""
                if delta and first is None:
                    first = time.perf_counter()
                text += delta
                reason = choice.get("finish_reason") or reason
            usage = obj.get("usage") or usage
            timings = obj.get("timings") or timings
    finally:
        conn.close()
    prompt_tokens = cached = completion = None
    if usage:
        prompt_tokens = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None and timings and "cache_n" in timings:
        cached = int(timings["cache_n"])
        prompt_tokens = prompt_tokens or cached + int(timings.get("prompt_n", 0))
    if completion is None and timings and "predicted_n" in timings:
        completion = int(timings["predicted_n"])
    return Reply(first, time.perf_counter(), [], text, reason, prompt_tokens, cached, completion)


def run_openai(cfg: Config, wl: ChatWorkload, url: str, tokenizer: Any, bar) -> list[Record]:
    """Drives an OpenAI-compatible server on 127.0.0.1 with cfg.concurrency requests in flight (threads), after
    one short warm-up request (as the other targets)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=cfg.concurrency)
    openai_request(url, cfg.model, [{"role": "user", "content": "Say hello."}], max_tokens=2)

    async def main() -> list[Record]:
        loop = asyncio.get_running_loop()

        async def send(messages: list[dict[str, str]]) -> Reply:
            reply = await loop.run_in_executor(pool, openai_request, url, cfg.model, messages, cfg.max_tokens)
            reply.output_ids = list(tokenizer.encode(reply.text, add_special_tokens=False))
            return reply

        return await drive_async(wl, cfg, send, bar)

    try:
        return asyncio.run(main())
    finally:
        pool.shutdown()
