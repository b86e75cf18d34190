"""ZeroMQ client library: a synchronous Client and an asyncio AsyncClient for the public endpoint.

Both keep many requests in flight on one DEALER socket: replies are routed by rid. A request that errs raises the
ServerError subclass of its ErrorResponse code; a request past its timeout is aborted on the server and raises
RequestTimeout; a stream that is left early (break, KeyboardInterrupt, asyncio cancellation, timeout) sends an
AbortRequest so the server frees its blocks. Messages are msgpack-encoded msgspec Structs (runtime/protocol/).
The exceptions live in runtime/client/errors.py, the request and result types in runtime/client/;
both are re-exported here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from runtime import protocol as p
from runtime.client.errors import (
    ClientError,
    RequestTimeout,
    ServerGoneError,
    error_from_response,
)
from runtime.client.results import Completion, _Collector
from runtime.client.wire import build_request, encode_request

logger = logging.getLogger(__name__)


LIVENESS_S = 15.0  # seconds of silence that mean the server is gone (it heartbeats waiting clients every 0.25 s)


def _gone(rid: str, endpoint: str, liveness_s: float) -> ServerGoneError:
    return ServerGoneError(
        rid, p.ERR_SERVER, f"nothing from {endpoint} for {liveness_s} s, not even a heartbeat: the server is gone"
    )


_decoder = msgspec.msgpack.Decoder(p.ServerMessage)


# What a request's inbox holds: every reply routed by rid (Heartbeats are not routed).
_Reply = p.StreamChunk | p.ErrorResponse | p.HealthResponse | p.StatsResponse | p.KvSnapshotResponse


def _new_rid() -> str:
    return uuid.uuid4().hex


_Box = TypeVar("_Box")


def _route(msg: _Reply, boxes: dict[str, _Box], endpoint: str) -> _Box | None:
    """The inbox of the request msg answers (None: drop msg). Replies to requests no longer waited on (aborted,
    timed out) are dropped; an ErrorResponse with rid "" (the server read no rid in a frame: only send_raw can send
    such a frame, every frame this client builds carries one) fails no request, since none can be told apart by it:
    it is logged at WARNING and dropped."""
    if isinstance(msg, p.ErrorResponse) and msg.rid == "":
        logger.warning(
            "%s rejected a frame it could not attribute to a request: [%s] %s", endpoint, msg.code, msg.message
        )
        return None
    return boxes.get(msg.rid)


_R = TypeVar("_R", p.StreamChunk, p.HealthResponse, p.StatsResponse, p.KvSnapshotResponse)
_ControlRequest = type[p.HealthRequest] | type[p.StatsRequest] | type[p.KvSnapshotRequest]


def _expect(msg: _Reply, kind: type[_R]) -> _R:
    """msg as the reply type its request asked for; raises ClientError when the server answered with another."""
    if not isinstance(msg, kind):
        raise ClientError(f"request {msg.rid}: expected {kind.__name__}, got {type(msg).__name__}")
    return msg


def _as_chunk(msg: _Reply) -> p.StreamChunk:
    return _expect(msg, p.StreamChunk)


class Client:
    """Synchronous client; one thread at a time (a ZeroMQ socket is not thread-safe).

    endpoint: the server's public endpoint, e.g. "tcp://127.0.0.1:5557". timeout: seconds a call may take before
    the request is aborted and RequestTimeout raised (None: wait forever). liveness_s: seconds without any frame from
    the server while a call waits before ServerGoneError (None: never). Use as a context manager or call close().
    A request whose arguments cannot be sent raises InvalidSamplingParams or InvalidInputError before anything is
    sent. An ErrorResponse with rid "" (answering a send_raw frame without a readable rid) is logged and dropped.
    """

    def __init__(self, endpoint: str, timeout: float | None = 120.0, liveness_s: float | None = LIVENESS_S) -> None:
        self.endpoint, self.timeout, self.liveness_s = endpoint, timeout, liveness_s
        self._last_heard = time.monotonic()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._inbox: dict[str, collections.deque[_Reply]] = {}
        self._n: dict[str, int] = {}

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Aborts requests still in flight and closes the socket."""
        for rid in list(self._inbox):
            self.abort(rid)
        self._sock.close(linger=100)

    def submit(
        self,
        *,
        prompt: str | None = None,
        messages: list | None = None,
        input_ids: list[int] | None = None,
        stream: bool = False,
        cache_salt: str | None = None,
        **params: Any,
    ) -> str:
        """Sends a GenerateRequest and returns its rid without waiting; read it with result(rid) or chunks(rid)."""
        rid = _new_rid()
        frame = encode_request(build_request(rid, prompt, messages, input_ids, stream, cache_salt, params))
        self._inbox[rid] = collections.deque()  # only once the frame is built: a rejected call leaves nothing behind
        self.send_raw(frame)
        return rid

    def send_raw(self, frame: bytes) -> None:
        """Sends one frame as is (for tests of the server's input checks)."""
        self._sock.send(frame)
        self._last_heard = time.monotonic()  # the liveness clock starts when a call starts waiting

    def abort(self, rid: str) -> None:
        """Cancels rid on the server (no reply); later messages for it are dropped."""
        self._inbox.pop(rid, None)
        self._sock.send(encode_request(p.AbortRequest(rid)))

    def _next(self, rid: str, deadline: float | None) -> _Reply:
        """The next reply to rid. Frames already waiting in the socket are read before either clock is judged: the
        liveness clock measures the server's silence, not the caller's (a caller that slept past liveness_s, or a
        stream consumer slow between chunks, finds the server's replies and heartbeats there). Raises the reply's
        ServerError, RequestTimeout past deadline, ServerGoneError after liveness_s s with nothing to read."""
        box = self._inbox[rid]
        while not box:
            if self._receive(0):
                continue
            now, liveness = time.monotonic(), self.liveness_s
            if deadline is not None and now >= deadline:
                self.abort(rid)
                raise RequestTimeout(f"request {rid} got no answer within {self.timeout} s")
            if liveness is not None and now - self._last_heard > liveness:
                self._inbox.pop(rid, None)
                raise _gone(rid, self.endpoint, liveness)
            gone_at = None if liveness is None else self._last_heard + liveness
            due = min(t for t in (now + 1.0, deadline, gone_at) if t is not None)  # the first clock due, or in 1 s
            self._receive(max(1, int((due - now) * 1000) + 1))
        msg = box.popleft()
        if isinstance(msg, p.ErrorResponse):
            self._inbox.pop(rid, None)
            raise error_from_response(msg)
        return msg

    def _receive(self, wait_ms: int) -> bool:
        """Reads one frame if one arrives within wait_ms (0: only a frame already waiting) and routes it to its inbox
        (a Heartbeat only restarts the liveness clock); True when a frame was read."""
        if not self._sock.poll(wait_ms, zmq.POLLIN):
            return False
        msg = _decoder.decode(self._sock.recv())
        self._last_heard = time.monotonic()
        if not isinstance(msg, p.Heartbeat) and (inbox := _route(msg, self._inbox, self.endpoint)) is not None:
            inbox.append(msg)
        return True

    def _deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    def chunks(self, rid: str) -> Iterator[p.StreamChunk]:
        """The StreamChunks of a submitted rid until every completion finished; leaving early aborts it."""
        deadline, done, n = self._deadline(), False, self._n.get(rid, 1)
        finished: set[int] = set()
        try:
            while not done:
                chunk = _as_chunk(self._next(rid, deadline))
                if chunk.finish_reason is not None:
                    finished.add(chunk.index)
                    done = len(finished) >= n
                yield chunk
        finally:
            if not done and rid in self._inbox:
                self.abort(rid)
            self._inbox.pop(rid, None)
            self._n.pop(rid, None)

    def stream(
        self,
        *,
        prompt: str | None = None,
        messages: list | None = None,
        input_ids: list[int] | None = None,
        cache_salt: str | None = None,
        **params: Any,
    ) -> Iterator[p.StreamChunk]:
        """Streams StreamChunks (text deltas, token ids; the last of each completion has finish_reason and usage).

        Breaking out, KeyboardInterrupt or a timeout sends AbortRequest. Raises ServerError subclasses."""
        rid = self.submit(
            prompt=prompt, messages=messages, input_ids=input_ids, stream=True, cache_salt=cache_salt, **params
        )
        self._n[rid] = params.get("n", 1)
        return self.chunks(rid)

    def result(self, rid: str, n: int = 1, start: float | None = None) -> Completion:
        """Waits for every completion of a submitted rid (n: its SamplingParams.n; start: perf_counter() at submit,
        for ttft_s). Leaving early (KeyboardInterrupt, timeout) aborts the request."""
        collector = _Collector(rid, n, time.perf_counter() if start is None else start)
        deadline, done = self._deadline(), False
        try:
            while not done:
                done = collector.add(_as_chunk(self._next(rid, deadline)))
        finally:
            if not done and rid in self._inbox:
                self.abort(rid)
            self._inbox.pop(rid, None)
        return collector.result()

    def generate(
        self,
        *,
        prompt: str | None = None,
        messages: list | None = None,
        input_ids: list[int] | None = None,
        cache_salt: str | None = None,
        **params: Any,
    ) -> Completion:
        """Runs one request to completion. params: SamplingParams fields (max_tokens, temperature, stop, n, ...).

        Raises InvalidSamplingParams or InvalidInputError before sending, ServerError subclasses, RequestTimeout."""
        start = time.perf_counter()
        rid = self.submit(prompt=prompt, messages=messages, input_ids=input_ids, cache_salt=cache_salt, **params)
        return self.result(rid, params.get("n", 1), start)

    def _control(self, msg_type: _ControlRequest) -> _Reply:
        rid = _new_rid()
        self._inbox[rid] = collections.deque()
        self.send_raw(encode_request(msg_type(rid)))
        try:
            return self._next(rid, self._deadline())
        finally:
            self._inbox.pop(rid, None)

    def health(self) -> str:
        """ "ok" when every server process serves; raises ServerError or RequestTimeout otherwise."""
        return _expect(self._control(p.HealthRequest), p.HealthResponse).status

    def stats(self) -> p.ServerStats:
        """The scheduler's ServerStats (running/waiting requests, blocks, hit rate, tokens/s)."""
        return _expect(self._control(p.StatsRequest), p.StatsResponse).stats

    def kv_snapshot(self) -> p.KvSnapshotResponse:
        """The resident block hashes, the last KV event seq they reflect, block_size and the KV events TCP port."""
        return _expect(self._control(p.KvSnapshotRequest), p.KvSnapshotResponse)


class AsyncClient:
    """asyncio client: many coroutines may use one AsyncClient; a reader task routes replies by rid.

    Use `async with AsyncClient(endpoint) as ac:`. timeout: seconds per call (None: wait forever). liveness_s: as
    in Client (ServerGoneError after that long without any frame while a call waits). Bad arguments and rid ""
    errors are handled as in Client.
    """

    def __init__(self, endpoint: str, timeout: float | None = 120.0, liveness_s: float | None = LIVENESS_S) -> None:
        self.endpoint, self.timeout, self.liveness_s = endpoint, timeout, liveness_s
        self._last_heard = time.monotonic()
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._queues: dict[str, asyncio.Queue[_Reply]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncClient:
        self._reader = asyncio.get_running_loop().create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Aborts requests in flight, stops the reader task and closes the socket."""
        for rid in list(self._queues):
            self._abort_nowait(rid)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close(linger=100)

    async def _read(self) -> None:
        while True:
            msg = _decoder.decode(await self._sock.recv())
            self._last_heard = time.monotonic()
            if not isinstance(msg, p.Heartbeat) and (queue := _route(msg, self._queues, self.endpoint)) is not None:
                queue.put_nowait(msg)

    def _abort_nowait(self, rid: str) -> None:
        self._queues.pop(rid, None)
        self._sock.send(encode_request(p.AbortRequest(rid)), flags=zmq.NOBLOCK)

    async def _next(self, rid: str, deadline: float | None) -> _Reply:
        queue = self._queues[rid]
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                msg = await asyncio.wait_for(queue.get(), 1.0 if left is None else min(left, 1.0))
                break
            except TimeoutError:
                if left is not None and left <= 1.0:
                    raise RequestTimeout(f"request {rid} got no answer within {self.timeout} s") from None
            if self.liveness_s is not None and time.monotonic() - self._last_heard > self.liveness_s:
                self._queues.pop(rid, None)
                raise _gone(rid, self.endpoint, self.liveness_s)
        if isinstance(msg, p.ErrorResponse):
            self._queues.pop(rid, None)
            raise error_from_response(msg)
        return msg

    def _deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    async def _submit(
        self,
        prompt: str | None,
        messages: list | None,
        input_ids: list[int] | None,
        stream: bool,
        cache_salt: str | None,
        params: dict[str, Any],
    ) -> str:
        return await self._send_request(
            build_request(_new_rid(), prompt, messages, input_ids, stream, cache_salt, params)
        )

    async def _send_request(self, request: p.GenerateRequest) -> str:
        frame = encode_request(request)
        self._queues[request.rid] = asyncio.Queue()
        await self._sock.send(frame)
        self._last_heard = time.monotonic()  # the liveness clock starts when a call starts waiting
        return request.rid

    async def stream(
        self,
        *,
        prompt: str | None = None,
        messages: list | None = None,
        input_ids: list[int] | None = None,
        cache_salt: str | None = None,
        **params: Any,
    ) -> AsyncIterator[p.StreamChunk]:
        """Async generator of StreamChunks; cancellation, aclose() or a timeout sends AbortRequest."""
        request = build_request(_new_rid(), prompt, messages, input_ids, True, cache_salt, params)
        async with contextlib.aclosing(self.stream_request(request)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def stream_request(self, request: p.GenerateRequest) -> AsyncGenerator[p.StreamChunk, None]:
        """stream() for a GenerateRequest built and validated by the caller (the HTTP server builds one from an
        OpenAI body), sent as is: its rid must be unique among this client's requests in flight and request.stream
        True. Async generator of StreamChunks; cancellation, aclose() or a timeout sends AbortRequest."""
        rid = await self._send_request(request)
        n = request.sampling_params.n
        deadline = self._deadline()
        finished: set[int] = set()
        try:
            while len(finished) < n:
                chunk = _as_chunk(await self._next(rid, deadline))
                if chunk.finish_reason is not None:
                    finished.add(chunk.index)
                yield chunk
        finally:
            if len(finished) < n and rid in self._queues:
                self._abort_nowait(rid)
            self._queues.pop(rid, None)

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
        rid = await self._submit(prompt, messages, input_ids, False, cache_salt, params)
        collector, deadline, done = _Collector(rid, params.get("n", 1), start), self._deadline(), False
        try:
            while not done:
                done = collector.add(_as_chunk(await self._next(rid, deadline)))
        finally:
            if not done and rid in self._queues:
                self._abort_nowait(rid)
            self._queues.pop(rid, None)
        return collector.result()

    async def _control(self, msg_type: _ControlRequest) -> _Reply:
        rid = _new_rid()
        self._queues[rid] = asyncio.Queue()
        await self._sock.send(encode_request(msg_type(rid)))
        self._last_heard = time.monotonic()
        try:
            return await self._next(rid, self._deadline())
        finally:
            self._queues.pop(rid, None)

    async def health(self) -> str:
        """ "ok" when every server process serves."""
        return _expect(await self._control(p.HealthRequest), p.HealthResponse).status

    async def stats(self) -> p.ServerStats:
        """The scheduler's ServerStats."""
        return _expect(await self._control(p.StatsRequest), p.StatsResponse).stats

    async def kv_snapshot(self) -> p.KvSnapshotResponse:
        """See Client.kv_snapshot."""
        return _expect(await self._control(p.KvSnapshotRequest), p.KvSnapshotResponse)
