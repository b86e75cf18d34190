"""One HTTP request's run through the backend: the StreamChunks of AsyncClient.stream, timed per completion for the
metrics, folded into per-choice results for non-streamed answers, and raced against the HTTP client's disconnect.

The backend is always asked to stream (one StreamChunk per step), so TTFT and inter-token latency are measured for
streamed and non-streamed requests alike.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from starlette.types import Receive

from runtime import protocol as p
from runtime.client import AsyncClient
from runtime.serve.http.request_map import BackendRequest

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was complete; its backend request was aborted."""


class ChoiceResult:
    """One completion as it accumulates: text, token_ids, logprobs (None unless asked for), finish_reason, usage
    (set with finish_reason), and its timing (perf_counter seconds) for the metrics."""

    def __init__(self, index: int, with_logprobs: bool) -> None:
        self.index = index
        self.texts: list[str] = []
        self.num_chars = 0  # characters of text so far
        self.token_ids: list[int] = []
        self.logprobs: list[p.TokenLogprobs | None] | None = [] if with_logprobs else None
        self.finish_reason: str | None = None
        self.usage: p.Usage | None = None
        self.first_token_t: float | None = None
        self.last_token_t: float | None = None
        self.itl_s: list[float] = []

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def add(self, chunk: p.StreamChunk, now: float) -> None:
        """Folds one chunk of this completion in; O(len(chunk))."""
        if chunk.token_ids:
            if self.last_token_t is None:
                self.first_token_t = now
            else:
                self.itl_s.append(now - self.last_token_t)
            self.last_token_t = now
        if chunk.text:
            self.texts.append(chunk.text)
            self.num_chars += len(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        if self.logprobs is not None:
            self.logprobs.extend(chunk.logprobs or [None] * len(chunk.token_ids))
        if chunk.finish_reason is not None:
            self.finish_reason, self.usage = chunk.finish_reason, chunk.usage


class Generation:
    """One request through the backend. Iterate chunks() once; choices holds every completion as it accumulates.

    metrics: an HttpMetrics (observe() is called once per completion as it finishes); arrival: perf_counter() when
    the HTTP request arrived (TTFT and end-to-end latency count from it)."""

    def __init__(self, client: AsyncClient, request: BackendRequest, metrics: Any, arrival: float) -> None:
        self.request, self.metrics, self.arrival = request, metrics, arrival
        params = request.sampling_params
        self.choices = [ChoiceResult(i, params.logprobs is not None) for i in range(params.n)]
        self._stream = client.stream_request(request.request)

    async def first(self) -> p.StreamChunk:
        """The first chunk (raises what AsyncClient raises: bad input, a backend error, the backend gone)."""
        return await self._stream.__anext__()

    async def chunks(self, first: p.StreamChunk | None = None) -> AsyncGenerator[p.StreamChunk, None]:
        """Every chunk (first: the one first() returned, yielded again), each folded into choices; leaving early
        (aclose, cancellation) aborts the backend request."""
        try:
            if first is not None:
                self._add(first)
                yield first
            async for chunk in self._stream:
                self._add(chunk)
                yield chunk
        finally:
            await self._stream.aclose()

    async def collect(self) -> list[ChoiceResult]:
        """Runs the request to its end; returns the choices."""
        async for _ in self.chunks():
            pass
        return self.choices

    def _add(self, chunk: p.StreamChunk) -> None:
        now = time.perf_counter()
        choice = self.choices[chunk.index]
        choice.add(chunk, now)
        if chunk.finish_reason is not None and self.metrics is not None:
            ttft = None if choice.first_token_t is None else choice.first_token_t - self.arrival
            queue_s = getattr(chunk.usage, "queue_time_s", None)
            self.metrics.observe(chunk.finish_reason, ttft, choice.itl_s, now - self.arrival, queue_s)


def usage_of(choices: list[ChoiceResult]) -> p.Usage:
    """The request's usage: prompt and cached tokens of the prompt, completion tokens summed over the choices."""
    usages = [c.usage for c in choices if c.usage is not None]
    if not usages:
        return p.Usage(0, 0, 0)
    return p.Usage(usages[0].prompt_tokens, usages[0].cached_tokens, sum(u.completion_tokens for u in usages))


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the ASGI receive channel reports http.disconnect (call it once the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """work's result, unless the HTTP client disconnects first: then work is cancelled (an AsyncClient call aborts
    its backend request on cancellation) and ClientDisconnected is raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
