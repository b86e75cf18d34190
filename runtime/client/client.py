"""The synchronous face of runtime.client: Client, over one zmq DEALER socket. It only sends, receives and waits;
routing, finish tracking, the clocks' judgements and the frames come from the sans-IO ClientCore
(runtime/client/core.py), the folding of chunks into a Completion from runtime.results.CompletionFold.

Many requests may be in flight on one Client (submit, then result or chunks in any order): replies are routed by
rid. A request that errs raises the ServerError subclass of its ErrorResponse code; a request past its timeout is
aborted on the server and raises RequestTimeout; a stream that is left early (break, KeyboardInterrupt, timeout)
sends an AbortRequest so the server frees its blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import zmq

from runtime import protocol as p
from runtime.client.core import LIVENESS_S, ClientCore, ControlRequest, CoreSettings, Outgoing, Reply, expect
from runtime.results import Completion, CompletionFold


class Client(CoreSettings):
    """Synchronous client; one thread at a time (a ZeroMQ socket is not thread-safe).

    endpoint: the server's public endpoint, e.g. "tcp://127.0.0.1:5557". timeout: seconds a call may take before
    the request is aborted and RequestTimeout raised (None: wait forever). liveness_s: seconds without any frame from
    the server while a call waits before ServerGoneError (None: never). Use as a context manager or call close().
    A request whose arguments cannot be sent raises InvalidSamplingParams or InvalidInputError before anything is
    sent. An ErrorResponse with rid "" (answering a send_raw frame without a readable rid) is logged and dropped.
    """

    def __init__(self, endpoint: str, timeout: float | None = 120.0, liveness_s: float | None = LIVENESS_S) -> None:
        super().__init__(ClientCore(endpoint, timeout, liveness_s, time.monotonic()))
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Aborts requests still in flight and closes the socket."""
        for rid in self._core.open_rids():
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
        out = self._core.open_generate(prompt, messages, input_ids, stream, cache_salt, params)
        self.send_raw(out.frame)
        return out.rid

    def send_raw(self, frame: bytes) -> None:
        """Sends one frame as is (for tests of the server's input checks)."""
        self._sock.send(frame)
        self._core.sent(time.monotonic())

    def abort(self, rid: str) -> None:
        """Cancels rid on the server (no reply); later messages for it are dropped."""
        self._sock.send(self._core.abort(rid))

    def _close(self, rid: str) -> None:
        """Stops waiting on rid, aborting it on the server when it had not ended."""
        frame = self._core.close(rid)
        if frame is not None:
            self._sock.send(frame)

    def _next(self, rid: str, deadline: float | None) -> Reply:
        """The next reply to rid. Frames already waiting in the socket are read before the clocks are judged (see
        ClientCore.wait_s). Raises the reply's ServerError, RequestTimeout, ServerGoneError."""
        while True:
            reply = self._core.pop(rid)
            if reply is not None:
                return reply
            if self._receive(0):
                continue
            wait = self._core.wait_s(rid, deadline, time.monotonic())
            self._receive(max(1, int(wait * 1000) + 1))

    def _receive(self, wait_ms: int) -> bool:
        """Reads one frame if one arrives within wait_ms (0: only a frame already waiting) and hands it to the core;
        True when a frame was read."""
        if not self._sock.poll(wait_ms, zmq.POLLIN):
            return False
        self._core.receive(self._sock.recv(), time.monotonic())
        return True

    def chunks(self, rid: str) -> Iterator[p.StreamChunk]:
        """The StreamChunks of a submitted rid until every completion finished; leaving early aborts it."""
        deadline = self._core.deadline(time.monotonic())
        try:
            while not self._core.finished(rid):
                yield expect(self._next(rid, deadline), p.StreamChunk)
        finally:
            self._close(rid)

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
        return self.chunks(rid)

    def result(self, rid: str, n: int | None = None, start: float | None = None) -> Completion:
        """Waits for every completion of a submitted rid (n: its SamplingParams.n, None: the n it was submitted
        with; start: perf_counter() at submit, for ttft_s). Leaving early (KeyboardInterrupt, timeout) aborts the
        request. Raises KeyError when rid is not in flight (never submitted, aborted, or already read)."""
        if n is None:
            n = self._core.completions(rid)
        if start is None:
            start = time.perf_counter()
        fold = CompletionFold(n, start)
        deadline = self._core.deadline(time.monotonic())
        try:
            while not fold.done:
                fold.add(expect(self._next(rid, deadline), p.StreamChunk), time.perf_counter())
        finally:
            self._close(rid)
        return fold.completion(rid)

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
        return self.result(rid, start=start)

    def _control(self, kind: ControlRequest) -> Reply:
        return self._one_reply(self._core.open_control(kind))

    def _one_reply(self, out: Outgoing) -> Reply:
        """Sends an opened request answered by one reply and waits for it (see _next for what it raises)."""
        self.send_raw(out.frame)
        try:
            return self._next(out.rid, self._core.deadline(time.monotonic()))
        finally:
            self._close(out.rid)

    def tokenize(
        self, *, prompt: str | None = None, messages: list | None = None, add_special_tokens: bool = True
    ) -> list[int]:
        """The prompt token ids the server computes for prompt (add_special_tokens: as a generate() prompt gets them)
        or for messages (the chat template applied), exactly one of them; nothing is generated. Raises
        InvalidInputError before sending, InvalidRequestError (neither or both given, text over the server's
        character limit, a failed chat template), ServerError subclasses, RequestTimeout."""
        out = self._core.open_tokenize(prompt, messages, add_special_tokens)
        return expect(self._one_reply(out), p.TokenizeResponse).token_ids

    def detokenize(self, token_ids: Iterable[int]) -> str:
        """The text of token_ids as the server's tokenizer decodes them (special tokens kept). Raises
        InvalidInputError before sending, InvalidRequestError (an id outside the vocabulary, more ids than the
        server's character limit), ServerError subclasses, RequestTimeout."""
        out = self._core.open_detokenize(token_ids)
        return expect(self._one_reply(out), p.DetokenizeResponse).text

    def health(self) -> str:
        """ "ok" when every server process serves; raises ServerError or RequestTimeout otherwise."""
        return expect(self._control(p.HealthRequest), p.HealthResponse).status

    def stats(self) -> p.ServerStats:
        """The scheduler's ServerStats (running/waiting requests, blocks, hit rate, tokens/s)."""
        return expect(self._control(p.StatsRequest), p.StatsResponse).stats

    def kv_snapshot(self) -> p.KvSnapshotResponse:
        """The resident block hashes, the last KV event seq they reflect, block_size and the KV events TCP port."""
        return expect(self._control(p.KvSnapshotRequest), p.KvSnapshotResponse)
