"""Server-Sent Events: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end, as the OpenAI API streams.

Each backend StreamChunk becomes one chat.completion.chunk (or text_completion chunk) of its choice; the first
chunk of each choice carries delta.role. A chunk that would say nothing (no text, no logprobs, no finish_reason: the
tokens of a stop string held back, an EOS) sends no event, so no `delta: {}` comes mid-stream. With
stream_options.include_usage every chunk has "usage": null and a last chunk with empty choices carries the usage;
with continuous_usage_stats as well, every chunk carries its choice's usage so far (prompt tokens, and the choice's
completion tokens up to this chunk), as vLLM sends it.
An error after the answer started is sent as an `{"error": ...}` event (the openai SDK raises it), then [DONE].
While the first chunk is awaited, a `: keep-alive` comment goes out every KEEPALIVE_S (runtime.serve.http.keepalive).
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
from runtime.serve.http.echo import StreamEcho
from runtime.serve.http.errors import OpenAIError, from_exception
from runtime.serve.http.generation import wait_disconnect
from runtime.serve.http.generation_group import AnyGeneration
from runtime.serve.http.keepalive import KEEPALIVE, wait_first
from runtime.serve.http.request_id import log_rejected
from runtime.serve.http.responses import chat_logprobs, completion_logprobs, usage_body
from runtime.serve.http.tool_answer import ToolCallStream
from runtime.serve.http.tool_request import ToolSetup

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
        self.continuous_usage = False  # vLLM's continuous_usage_stats: each chunk's "usage" is its choice's so far
        self.scope: Scope = {}  # the HTTP request's, for the log line of an error in the stream

    def event(self, choice: dict[str, Any], usage: p.Usage | None = None) -> bytes:
        """The event of one choice's chunk; usage: the choice's usage so far (StreamChunk.usage), sent when
        continuous_usage is on ("usage": null otherwise, with include_usage)."""
        body = {**self.header, "choices": [choice]}
        if self.continuous_usage and usage is not None:
            body["usage"] = usage_body(usage)
        elif self.include_usage:
            body["usage"] = None
        return sse(body)


def _says_nothing(chunk: p.StreamChunk, logprobs: bool) -> bool:
    return not chunk.text and chunk.finish_reason is None and not (logprobs and chunk.token_ids)


def chat_events(
    gen: AnyGeneration, first: asyncio.Task[p.StreamChunk], ctx: StreamContext, tools: ToolSetup | None = None
) -> AsyncGenerator[bytes, None]:
    """The events of a streamed chat completion (first: the task of its first backend chunk, done or not yet);
    tools: how tool calls are read (runtime.serve.http.tool_answer; None: the text is all content)."""
    started: set[int] = set()
    calls: dict[int, ToolCallStream] = {}

    def choices(chunk: p.StreamChunk) -> list[dict[str, Any]]:
        if chunk.index in started and _says_nothing(chunk, ctx.logprobs):
            return []
        logprobs = None
        if ctx.logprobs:
            logprobs = chat_logprobs(
                chunk.token_ids, chunk.logprobs or [None] * len(chunk.token_ids), chunk.token_texts
            )
        finish = chunk.finish_reason
        if tools is None:
            deltas = [{"content": chunk.text} if chunk.text or chunk.index not in started else {}]
        else:
            stream = calls.setdefault(chunk.index, ToolCallStream(tools))
            deltas = stream.deltas(chunk.text, finish is not None)
            finish = stream.finish_reason(finish)
            if not deltas and (chunk.index not in started or logprobs is not None or finish is not None):
                deltas = [{}]
        if deltas and chunk.index not in started:
            started.add(chunk.index)
            deltas[0] = {"role": "assistant", **deltas[0]}
        last = len(deltas) - 1
        return [
            {
                "index": chunk.index,
                "delta": delta,
                "logprobs": logprobs if i == 0 else None,
                "finish_reason": finish if i == last else None,
            }
            for i, delta in enumerate(deltas)
        ]

    return _events(gen, first, ctx, choices)


def completion_events(
    gen: AnyGeneration, first: asyncio.Task[p.StreamChunk], ctx: StreamContext, echo: StreamEcho | None = None
) -> AsyncGenerator[bytes, None]:
    """The events of a streamed text completion (first: the task of its first backend chunk, done or not yet); echo:
    the prompt to add (echo, prompt_logprobs: runtime/serve/http/echo.py), None when not asked."""

    def choice(chunk: p.StreamChunk) -> list[dict[str, Any]]:
        if echo is None and _says_nothing(chunk, ctx.logprobs):
            return []
        logprobs = None
        if ctx.logprobs:
            offset = gen.fold.num_chars(chunk.index) - len(chunk.text)
            logprobs = completion_logprobs(
                chunk.token_ids, chunk.logprobs or [None] * len(chunk.token_ids), chunk.token_texts, offset
            )
        body = {"index": chunk.index, "text": chunk.text, "logprobs": logprobs, "finish_reason": chunk.finish_reason}
        if echo is None:
            return [body]
        echoed = echo.choice(chunk, body)
        return [] if echoed is None else [echoed]

    return _events(gen, first, ctx, choice)


async def _events(
    gen: AnyGeneration, first: asyncio.Task[p.StreamChunk], ctx: StreamContext, choices: Any
) -> AsyncGenerator[bytes, None]:
    """Keep-alive comments until the first chunk (keepalive.wait_first), then one event per choice dict
    choices(chunk) returns for each chunk (none for []), then the usage chunk, [DONE]."""
    try:
        async for _ in wait_first(first):
            yield KEEPALIVE
        chunks = gen.chunks(first.result())
    except (ClientError, OpenAIError) as exc:
        error = from_exception(exc, gen.request.param_names, gen.request.prompt_param)
        log_rejected(ctx.scope, error.status, f"before its first chunk: {error.message}")
        yield sse(error.body())
        yield DONE
        return
    try:
        async for chunk in chunks:
            for body in choices(chunk):
                yield ctx.event(body, chunk.usage)
        if ctx.include_usage:
            yield sse({**ctx.header, "choices": [], "usage": usage_body(gen.usage())})
    except (ClientError, OpenAIError) as exc:
        error = from_exception(exc, gen.request.param_names, gen.request.prompt_param)
        log_rejected(ctx.scope, error.status, f"in its stream: {error.message}")
        yield sse(error.body())
    finally:
        await chunks.aclose()
    yield DONE
