"""Server-Sent Events: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end, as the OpenAI API streams.

Each backend StreamChunk becomes one chat.completion.chunk (or text_completion chunk) of its choice; the first
chunk of each choice carries delta.role. With stream_options.include_usage every chunk has "usage": null and a
last chunk with empty choices carries the usage. An error after the answer started is sent as an `{"error": ...}`
event (the openai SDK raises it), then [DONE]. While the first chunk is awaited, a `: keep-alive` comment goes out
every KEEPALIVE_S (runtime.serve.http.keepalive).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from runtime import protocol as p
from runtime.client.errors import ClientError
from runtime.serve.http.errors import OpenAIError, from_exception
from runtime.serve.http.generation import Generation, wait_disconnect
from runtime.serve.http.keepalive import KEEPALIVE, wait_first
from runtime.serve.http.responses import chat_logprobs, completion_logprobs, usage_body

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: Any) -> bytes:
    """One event: `data: <json>\\n\\n`."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class EventStream(Response):
    """A text/event-stream response, lean on the first event (it sends the headers and the first event right away:
    no task group per stream, as starlette's StreamingResponse makes) and strict on the end: a client disconnect
    (http.disconnect) cancels the stream at once, and the event generator is closed however the response ends
    (finished, the client gone, the server shutting down), so the backend request is aborted at once, not when
    the generator is garbage collected."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        finished = False  # set right after the last send: the disconnect a complete response reports cancels nothing

        def on_disconnect(watch: asyncio.Future[None]) -> None:
            if not watch.cancelled() and not finished:
                task.cancel()

        watch = asyncio.ensure_future(wait_disconnect(receive))
        watch.add_done_callback(on_disconnect)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self._events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            finished = True
        except asyncio.CancelledError:
            if not (watch.done() and not watch.cancelled()):
                raise
            task.uncancel()  # the client left: nothing more to send, and nothing to cancel above us
        finally:
            watch.cancel()
            await self._events.aclose()


class StreamContext:
    """What every event of one answer shares: the object header (id, object, created, model), whether logprobs and
    the usage chunk were asked for."""

    def __init__(
        self, rid: str, object_name: str, created: int, model: str, logprobs: bool, include_usage: bool
    ) -> None:
        self.header = {"id": rid, "object": object_name, "created": created, "model": model}
        self.logprobs = logprobs
        self.include_usage = include_usage

    def event(self, choice: dict[str, Any]) -> bytes:
        body = {**self.header, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return sse(body)


def chat_events(gen: Generation, first: asyncio.Task[p.StreamChunk], ctx: StreamContext) -> AsyncGenerator[bytes, None]:
    """The events of a streamed chat completion (first: the task of its first backend chunk, done or not yet)."""
    started: set[int] = set()

    def choice(chunk: p.StreamChunk) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": chunk.text} if chunk.text or chunk.index not in started else {}
        if chunk.index not in started:
            started.add(chunk.index)
            delta = {"role": "assistant", **delta}
        logprobs = None
        if ctx.logprobs:
            logprobs = chat_logprobs(
                chunk.token_ids, chunk.logprobs or [None] * len(chunk.token_ids), chunk.token_texts
            )
        return {"index": chunk.index, "delta": delta, "logprobs": logprobs, "finish_reason": chunk.finish_reason}

    return _events(gen, first, ctx, choice)


def completion_events(
    gen: Generation, first: asyncio.Task[p.StreamChunk], ctx: StreamContext
) -> AsyncGenerator[bytes, None]:
    """The events of a streamed text completion (first: the task of its first backend chunk, done or not yet)."""

    def choice(chunk: p.StreamChunk) -> dict[str, Any]:
        logprobs = None
        if ctx.logprobs:
            offset = gen.fold.num_chars(chunk.index) - len(chunk.text)
            logprobs = completion_logprobs(
                chunk.token_ids, chunk.logprobs or [None] * len(chunk.token_ids), chunk.token_texts, offset
            )
        return {"index": chunk.index, "text": chunk.text, "logprobs": logprobs, "finish_reason": chunk.finish_reason}

    return _events(gen, first, ctx, choice)


async def _events(
    gen: Generation, first: asyncio.Task[p.StreamChunk], ctx: StreamContext, choice: Any
) -> AsyncGenerator[bytes, None]:
    try:
        async for _ in wait_first(first):
            yield KEEPALIVE
        chunks = gen.chunks(first.result())
    except (ClientError, OpenAIError) as exc:
        yield sse(from_exception(exc, gen.request.param_names, gen.request.prompt_param).body())
        yield DONE
        return
    try:
        async for chunk in chunks:
            yield ctx.event(choice(chunk))
        if ctx.include_usage:
            yield sse({**ctx.header, "choices": [], "usage": usage_body(gen.usage())})
    except (ClientError, OpenAIError) as exc:
        yield sse(from_exception(exc, gen.request.param_names, gen.request.prompt_param).body())
    finally:
        await chunks.aclose()
    yield DONE
