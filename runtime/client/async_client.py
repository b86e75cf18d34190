"""The asyncio face of runtime.client: AsyncClient, over one zmq.asyncio DEALER socket. A reader task hands every
frame to the sans-IO ClientCore (runtime/client/core.py), which routes it by rid, and wakes the coroutine waiting on
that rid; the coroutines only send and wait. Semantics as the synchronous Client's (runtime/client/client.py):
errors, timeouts (the request is aborted on the server), liveness, and a stream left early (cancellation, aclose())
sends an AbortRequest. One more than the synchronous face: a socket monitor fails every request in flight with
ServerGoneError the moment the connection to the server drops (its process died), not liveness_s later; the HTTP
server's streams end with an error event at once when the tokenizer process dies.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any

import zmq
import zmq.asyncio
import zmq.utils.monitor

from runtime import protocol as p
from runtime.client.core import LIVENESS_S, ClientCore, ControlRequest, CoreSettings, Outgoing, Reply, expect
from runtime.results import Completion, CompletionFold


class AsyncClient(CoreSettings):
    """asyncio client: many coroutines may use one AsyncClient; a reader task routes replies by rid.

    Use `async with AsyncClient(endpoint) as ac:`. timeout: seconds per call (None: wait forever). liveness_s: as
    in Client (ServerGoneError after that long without any frame while a call waits). Bad arguments and rid ""
    errors are handled as in Client.
    """

    def __init__(self, endpoint: str, timeout: float | None = 120.0, liveness_s: float | None = LIVENESS_S) -> None:
        super().__init__(ClientCore(endpoint, timeout, liveness_s, time.monotonic()))
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._arrived: dict[str, asyncio.Event] = {}  # rid -> set when a reply to it is routed
        self._reader: asyncio.Task[None] | None = None
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._watcher: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncClient:
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read())
        self._watcher = loop.create_task(self._watch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Aborts requests in flight, stops the reader task and closes the socket."""
        for rid in self._core.open_rids():
            self._arrived.pop(rid, None)
            self._sock.send(self._core.abort(rid), flags=zmq.NOBLOCK)
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=100)

    async def _read(self) -> None:
        while True:
            frame = await self._sock.recv()
            rid = self._core.receive(frame, time.monotonic())
            arrived = None if rid is None else self._arrived.get(rid)
            if arrived is not None:
                arrived.set()

    async def _watch(self) -> None:
        """Fails every request in flight at once when the connection to the server drops (its process died: a
        tokenizer crash, a killed server), instead of after liveness_s of silence."""
        while True:
            event = zmq.utils.monitor.parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            reason = f"the connection to {self._core.endpoint} closed: the server is gone"
            for rid in self._core.lost(reason):
                arrived = self._arrived.get(rid)
                if arrived is not None:
                    arrived.set()

    async def _send(self, out: Outgoing) -> None:
        """Sends an opened request's frame; the caller's cleanup must _close(out.rid), also if this is cancelled."""
        self._arrived[out.rid] = asyncio.Event()
        await self._sock.send(out.frame)
        self._core.sent(time.monotonic())

    def _close(self, rid: str) -> None:
        """Stops waiting on rid, aborting it on the server when it had not ended (without waiting: this runs in
        cleanup, also on cancellation)."""
        self._arrived.pop(rid, None)
        frame = self._core.close(rid)
        if frame is not None:
            self._sock.send(frame, flags=zmq.NOBLOCK)

    async def _next(self, rid: str, deadline: float | None) -> Reply:
        """The next reply to rid; raises its ServerError, RequestTimeout, ServerGoneError (see ClientCore.wait_s)."""
        arrived = self._arrived[rid]
        while True:
            arrived.clear()  # no await until the wait below: a reply routed meanwhile sets it again
            reply = self._core.pop(rid)
            if reply is not None:
                return reply
            wait = self._core.wait_s(rid, deadline, time.monotonic())
            try:
                await asyncio.wait_for(arrived.wait(), wait)
            except TimeoutError:
                pass  # judged again above

    def stream(
        self,
        *,
        prompt: str | None = None,
        messages: list | None = None,
        input_ids: list[int] | None = None,
        cache_salt: str | None = None,
        **params: Any,
    ) -> AsyncGenerator[p.StreamChunk, None]:
        """Async generator of StreamChunks; cancellation, aclose() or a timeout sends AbortRequest. Bad arguments
        raise (InvalidSamplingParams, InvalidInputError) on the first iteration, before anything is sent."""
        build = functools.partial(self._core.open_generate, prompt, messages, input_ids, True, cache_salt, params)
        return self._chunks(build)

    def stream_request(self, request: p.GenerateRequest) -> AsyncGenerator[p.StreamChunk, None]:
        """stream() for a GenerateRequest built and validated by the caller (the HTTP server builds one from an
        OpenAI body), sent as is: its rid must be unique among this client's requests in flight (InvalidInputError
        otherwise) and request.stream True. Async generator of StreamChunks; cancellation, aclose() or a timeout
        sends AbortRequest."""
        return self._chunks(functools.partial(self._core.open_request, request))

    async def _chunks(self, open_request: Callable[[], Outgoing]) -> AsyncGenerator[p.StreamChunk, None]:
        """The chunks of the request open_request opens (on the first iteration) until every completion finished."""
        out = open_request()
        try:
            await self._send(out)
            deadline = self._core.deadline(time.monotonic())
            while not self._core.finished(out.rid):
                yield expect(await self._next(out.rid, deadline), p.StreamChunk)
        finally:
            self._close(out.rid)

    async def generate(
        self,
        *,
        prompt: str | None = None,
        messages: list | None = None,
        input_ids: list[int] | None = None,
        cache_salt: str | None = None,
        **params: Any,
    ) -> Completion:
        """Runs one request to completion; see Client.generate. Cancellation aborts it on the server."""
        start = time.perf_counter()
        out = self._core.open_generate(prompt, messages, input_ids, False, cache_salt, params)
        fold = CompletionFold(self._core.completions(out.rid), start)
        try:
            await self._send(out)
            deadline = self._core.deadline(time.monotonic())
            while not fold.done:
                fold.add(expect(await self._next(out.rid, deadline), p.StreamChunk), time.perf_counter())
        finally:
            self._close(out.rid)
        return fold.completion(out.rid)

    async def _control(self, kind: ControlRequest) -> Reply:
        return await self._one_reply(self._core.open_control(kind))

    async def _one_reply(self, out: Outgoing) -> Reply:
        """Sends an opened request answered by one reply and waits for it; cancellation stops waiting."""
        try:
            await self._send(out)
            return await self._next(out.rid, self._core.deadline(time.monotonic()))
        finally:
            self._close(out.rid)

    async def tokenize(
        self, *, prompt: str | None = None, messages: list | None = None, add_special_tokens: bool = True
    ) -> list[int]:
        """See Client.tokenize."""
        out = self._core.open_tokenize(prompt, messages, add_special_tokens)
        return expect(await self._one_reply(out), p.TokenizeResponse).token_ids

    async def detokenize(self, token_ids: Iterable[int]) -> str:
        """See Client.detokenize."""
        out = self._core.open_detokenize(token_ids)
        return expect(await self._one_reply(out), p.DetokenizeResponse).text

    async def health(self) -> str:
        """ "ok" when every server process serves."""
        return expect(await self._control(p.HealthRequest), p.HealthResponse).status

    async def stats(self) -> p.ServerStats:
        """The scheduler's ServerStats."""
        return expect(await self._control(p.StatsRequest), p.StatsResponse).stats

    async def kv_snapshot(self) -> p.KvSnapshotResponse:
        """See Client.kv_snapshot."""
        return expect(await self._control(p.KvSnapshotRequest), p.KvSnapshotResponse)
