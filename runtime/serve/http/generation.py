"""One HTTP request's run through the backend: the StreamChunks of AsyncClient.stream, folded by
runtime.results.CompletionFold (as the client's and the Engine's results are) into the choices and usage of
non-streamed answers and of the include_usage chunk, timed per completion beside the fold for the metrics, and raced
against the HTTP client's disconnect.

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
from runtime.results import Choice, CompletionFold
from runtime.serve.http.request_map import BackendRequest

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was complete; its backend request was aborted."""


class ChoiceTiming:
    """One completion's timing for the metrics (perf_counter seconds): its first and last token, and every gap
    between consecutive chunks with tokens (inter-token latency)."""

    def __init__(self) -> None:
        self.first_token_t: float | None = None
        self.last_token_t: float | None = None
        self.itl_s: list[float] = []

    def add(self, chunk: p.StreamChunk, now: float) -> None:
        """Times one chunk of this completion that arrived at now; O(1)."""
        if not chunk.token_ids:
            return
        if self.last_token_t is None:
            self.first_token_t = now
        else:
            self.itl_s.append(now - self.last_token_t)
        self.last_token_t = now


class Generation:
    """One request through the backend. Iterate chunks() once; fold holds every completion as it accumulates
    (runtime.results.CompletionFold), timings each completion's timing.

    metrics: an HttpMetrics (observe() is called once per completion as it finishes); arrival: perf_counter() when
    the HTTP request arrived (TTFT and end-to-end latency count from it)."""

    def __init__(self, client: AsyncClient, request: BackendRequest, metrics: Any, arrival: float) -> None:
        self.request = request
        self.metrics = metrics
        self.arrival = arrival
        n = request.sampling_params.n
        self.fold = CompletionFold(n, arrival)
        self.timings = [ChoiceTiming() for _ in range(n)]
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

    async def collect(self) -> list[Choice]:
        """Runs the request to its end; returns the choices."""
        async for _ in self.chunks():
            pass
        return self.fold.choices()

    async def close(self) -> None:
        """Closes the backend stream (aborting the request if it still runs); call it when nothing iterates it."""
        await self._stream.aclose()

    def usage(self) -> p.Usage:
        """The request's usage so far: CompletionFold.usage (every Usage field, queue_time_s and host_cached_tokens
        included; completion_tokens summed over the choices). The OpenAI usage body carries only its token counts
        (responses.usage_body)."""
        return self.fold.usage()

    def _add(self, chunk: p.StreamChunk) -> None:
        now = time.perf_counter()
        self.fold.add(chunk, now)
        timing = self.timings[chunk.index]
        timing.add(chunk, now)
        if chunk.finish_reason is not None and self.metrics is not None:
            ttft = None if timing.first_token_t is None else timing.first_token_t - self.arrival
            queue_s = getattr(chunk.usage, "queue_time_s", None)
            self.metrics.observe(chunk.finish_reason, ttft, timing.itl_s, now - self.arrival, queue_s)


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
