"""A streamed answer starts within KEEPALIVE_S and stays alive: a request whose first backend chunk is slow to come
(beam search, which sends nothing until its beams end; a long queue) gets its response headers after KEEPALIVE_S and
an SSE comment line (`: keep-alive`, which SSE clients and the openai SDK skip) every KEEPALIVE_S until the first
chunk, so proxies and clients with read timeouts keep the connection. A first chunk (or an error) within KEEPALIVE_S
is answered as before: bad input is still an HTTP 400, not an error event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from starlette.types import Receive

from runtime import protocol as p
from runtime.serve.http.generation import ClientDisconnected, race_disconnect
from runtime.serve.http.generation_group import AnyGeneration

KEEPALIVE_S = 1.0  # seconds without an event before the headers go out, and between keep-alive comments
KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: no event for the client


async def start_first(gen: AnyGeneration, receive: Receive, wait_s: float = KEEPALIVE_S) -> asyncio.Task[p.StreamChunk]:
    """Starts waiting for gen's first chunk and gives it wait_s seconds. Returns its task, done (its chunk) or still
    pending (the answer then starts with keep-alive comments: wait_first). Raises what the first chunk raised when it
    failed within wait_s (bad input, the backend gone), and ClientDisconnected when the HTTP client left meanwhile
    (the task is cancelled: its backend request is aborted)."""
    task = asyncio.ensure_future(gen.first())
    try:
        await race_disconnect(asyncio.wait({task}, timeout=wait_s), receive)
    except ClientDisconnected:
        await cancel(task)
        raise
    if task.done():
        task.result()  # raises the first chunk's error
    return task


async def wait_first(task: asyncio.Task[p.StreamChunk], every_s: float = KEEPALIVE_S) -> AsyncGenerator[None, None]:
    """Yields once every every_s seconds until task is done (the caller sends KEEPALIVE each time); cancels task
    when left early (the client went away: its backend request is aborted)."""
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=every_s)
            if not task.done():
                yield None
    finally:
        await cancel(task)


async def cancel(task: asyncio.Task) -> None:
    """Cancels task unless done and waits for it to end (its exception, if any, is dropped)."""
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)
