"""A completions request with a list of prompts: one Generation per prompt, run at once, seen as one.

Choice indices follow OpenAI's rule for a batch of prompts: prompt i's sample j is choice i * n + j (n: the
request's SamplingParams.n), in answers and in stream chunks alike. The usage is the sum over the prompts (prompt,
cached and completion tokens). The group has the Generation interface the routes and the SSE writer use (request,
fold, first, chunks, collect, usage), so one code path serves one prompt or many.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import msgspec

from runtime import protocol as p
from runtime.results import Choice, CompletionFold
from runtime.serve.http.generation import Generation

_END = object()  # a pump's last item


class GenerationGroup:
    """The Generations of one request's prompts (gens[i]: prompt i), each with n completions. fold: the group's
    chunks (indices remapped) folded as they are yielded; the Generations keep their own folds for their usage.

    A failure of any prompt (at first(), or later in chunks() / collect()) closes every Generation (their backend
    requests are aborted) and raises what that prompt raised."""

    def __init__(self, gens: list[Generation]) -> None:
        self.gens = gens
        self.request = gens[0].request
        self.n = self.request.sampling_params.n
        self.fold = CompletionFold(self.n * len(gens), gens[0].arrival)
        self._firsts: list[p.StreamChunk] | None = None

    def _remap(self, i: int, chunk: p.StreamChunk) -> p.StreamChunk:
        return msgspec.structs.replace(chunk, index=i * self.n + chunk.index)

    async def first(self) -> p.StreamChunk:
        """Waits for every prompt's first chunk (so a bad prompt is an error before the answer starts); returns the
        first one of prompt 0, remapped. chunks() yields it (and the other prompts' firsts) again."""
        tasks = [asyncio.ensure_future(g.first()) for g in self.gens]
        try:
            self._firsts = list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()
            raise
        return self._remap(0, self._firsts[0])

    async def chunks(self, first: p.StreamChunk | None = None) -> AsyncGenerator[p.StreamChunk, None]:
        """Every prompt's chunks as they arrive, indices remapped, each folded into fold (first: what first()
        returned, or None when first() was not called; it comes again from here). Leaving early closes every
        Generation."""
        firsts: list[p.StreamChunk | None] = [None] * len(self.gens) if self._firsts is None else [*self._firsts]
        queue: asyncio.Queue[Any] = asyncio.Queue()
        pumps = [
            asyncio.ensure_future(_pump(i, g.chunks(f), queue))
            for i, (g, f) in enumerate(zip(self.gens, firsts, strict=True))
        ]
        running = len(pumps)
        try:
            while running:
                i, item = await queue.get()
                if item is _END:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    chunk = self._remap(i, item)
                    self.fold.add(chunk, time.perf_counter())
                    yield chunk
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await self.close()

    async def collect(self) -> list[Choice]:
        """Runs every prompt to its end; returns the choices, by index (prompt i's sample j at i * n + j)."""
        async for _ in self.chunks():
            pass
        return self.fold.choices()

    def usage(self) -> p.Usage:
        """The sum of the prompts' usages (each Generation.usage(): its prompt and cached tokens once, its
        completions' tokens summed); queue_time_s: the longest of them (None when none is known)."""
        usages = [g.usage() for g in self.gens]
        queued = [u.queue_time_s for u in usages if u.queue_time_s is not None]
        return p.Usage(
            sum(u.prompt_tokens for u in usages),
            sum(u.cached_tokens for u in usages),
            sum(u.completion_tokens for u in usages),
            max(queued) if queued else None,
            sum(u.host_cached_tokens for u in usages),
        )

    async def close(self) -> None:
        """Closes every Generation (aborting the backend requests still running)."""
        await asyncio.gather(*(g.close() for g in self.gens), return_exceptions=True)


async def _pump(i: int, chunks: AsyncIterator[p.StreamChunk], queue: asyncio.Queue[Any]) -> None:
    """Puts (i, chunk) for each of chunks on queue, then (i, _END), or (i, the exception) when it raised."""
    try:
        async for chunk in chunks:
            queue.put_nowait((i, chunk))
    except Exception as exc:
        queue.put_nowait((i, exc))
        return
    queue.put_nowait((i, _END))


AnyGeneration = Generation | GenerationGroup  # what the routes and the SSE writer run: one prompt or several
