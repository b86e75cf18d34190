"""The sans-IO core of runtime.client: what the synchronous Client and the AsyncClient share, with no socket, no
event loop and no clock of its own (every judgement is given `now`, time.monotonic() seconds).

It builds the frames to send (requests, control requests, aborts), routes each frame received to the request it
answers by rid, tracks which completions of a request finished, turns an ErrorResponse into its typed ServerError,
and judges a waiting request's two clocks: its deadline (RequestTimeout) and the server's silence (ServerGoneError
after liveness_s seconds without any frame, heartbeats included). The faces only send, receive and wait.
"""

from __future__ import annotations

import collections
import logging
import uuid
from collections.abc import Iterable
from typing import Any, NamedTuple, TypeVar

import msgspec

from runtime import protocol as p
from runtime.client.errors import ClientError, InvalidInputError, RequestTimeout, ServerGoneError, error_from_response
from runtime.client.wire import build_detokenize, build_request, build_tokenize, encode_request

logger = logging.getLogger(__name__)

LIVENESS_S = 15.0  # seconds of silence that mean the server is gone (it heartbeats waiting clients every 0.25 s)
JUDGE_EVERY_S = 1.0  # the longest a face waits for a frame before the clocks are judged again

# What a request's inbox holds: every reply routed by rid (Heartbeats are not routed).
Reply = (
    p.StreamChunk
    | p.ErrorResponse
    | p.HealthResponse
    | p.StatsResponse
    | p.KvSnapshotResponse
    | p.TokenizeResponse
    | p.DetokenizeResponse
)
ControlRequest = type[p.HealthRequest] | type[p.StatsRequest] | type[p.KvSnapshotRequest]
R = TypeVar(
    "R",
    p.StreamChunk,
    p.HealthResponse,
    p.StatsResponse,
    p.KvSnapshotResponse,
    p.TokenizeResponse,
    p.DetokenizeResponse,
)

_decoder = msgspec.msgpack.Decoder(p.ServerMessage)


class Outgoing(NamedTuple):
    """A request opened by the core: its rid and the one frame the face must send for it."""

    rid: str
    frame: bytes


class _Open:
    """A request the client still waits on: the replies routed to it and not yet taken, its completions (n; a
    control request has one, ended by its reply) and the indices of those that finished."""

    def __init__(self, n: int) -> None:
        self.inbox: collections.deque[Reply] = collections.deque()
        self.n = n
        self.finished: set[int] = set()
        self.lost: str | None = None  # why the connection it was sent on closed (then no reply can come)

    @property
    def done(self) -> bool:
        return len(self.finished) >= self.n


def expect(reply: Reply, kind: type[R]) -> R:
    """reply as the type its request asked for; raises ClientError when the server answered with another."""
    if not isinstance(reply, kind):
        raise ClientError(f"request {reply.rid}: expected {kind.__name__}, got {type(reply).__name__}")
    return reply


class ClientCore:
    """The state of one client connection: the requests in flight (rid -> inbox and finish tracking) and when the
    server was last heard from.

    endpoint: named in errors. timeout: seconds a call may wait (None: forever). liveness_s: seconds without any
    frame while a call waits before ServerGoneError (None: never). now: the clock's reading at construction.
    Not thread-safe; O(1) per frame.
    """

    def __init__(self, endpoint: str, timeout: float | None, liveness_s: float | None, now: float) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.liveness_s = liveness_s
        self.last_heard = now
        self._open: dict[str, _Open] = {}

    # ------------------------------------------------------------------ frames to send
    def open_generate(
        self,
        prompt: str | None,
        messages: list | None,
        input_ids: list[int] | None,
        stream: bool,
        cache_salt: str | None,
        params: dict[str, Any],
    ) -> Outgoing:
        """Opens a GenerateRequest built from generate()/stream() arguments under a new rid (see open_request).
        Raises InvalidSamplingParams or InvalidInputError (wire.build_request / encode_request), and then opens
        nothing: a refused call leaves no request behind."""
        return self.open_request(
            build_request(uuid.uuid4().hex, prompt, messages, input_ids, stream, cache_salt, params)
        )

    def open_request(self, request: p.GenerateRequest) -> Outgoing:
        """Opens a GenerateRequest built by the caller (its SamplingParams.n completions tracked) and returns its
        frame. Raises InvalidInputError when msgpack cannot carry it or its rid is already in flight, and then opens
        nothing."""
        if request.rid in self._open:
            raise InvalidInputError(f"rid {request.rid!r} is already in flight on this client")
        frame = encode_request(request)
        self._open[request.rid] = _Open(request.sampling_params.n)
        return Outgoing(request.rid, frame)

    def open_control(self, kind: ControlRequest) -> Outgoing:
        """Opens a control request (health, stats, KV snapshot) under a new rid; it ends with its one reply."""
        return self._open_one(kind(uuid.uuid4().hex))

    def open_tokenize(self, prompt: str | None, messages: list | None, add_special_tokens: bool) -> Outgoing:
        """Opens a TokenizeRequest under a new rid (it ends with its one reply). Raises InvalidInputError (a chat
        message that is neither a ChatMessage nor a dict with role and content, text msgpack cannot carry), and then
        opens nothing."""
        return self._open_one(build_tokenize(uuid.uuid4().hex, prompt, messages, add_special_tokens))

    def open_detokenize(self, token_ids: Iterable[int]) -> Outgoing:
        """Opens a DetokenizeRequest under a new rid (it ends with its one reply). Raises InvalidInputError (ids that
        are not integers, an id msgpack cannot carry), and then opens nothing."""
        return self._open_one(build_detokenize(uuid.uuid4().hex, token_ids))

    def _open_one(self, msg: p.ClientMessage) -> Outgoing:
        """Opens a request answered by one reply (control, tokenize, detokenize) and returns its frame."""
        frame = encode_request(msg)
        self._open[msg.rid] = _Open(1)
        return Outgoing(msg.rid, frame)

    def sent(self, now: float) -> None:
        """The face sent a request: the liveness clock starts now (it measures silence while a call waits)."""
        self.last_heard = now

    def abort(self, rid: str) -> bytes:
        """Forgets rid (later replies to it are dropped) and returns the AbortRequest frame to send for it."""
        self._open.pop(rid, None)
        return encode_request(p.AbortRequest(rid))

    def close(self, rid: str) -> bytes | None:
        """Forgets rid once its caller stops waiting; returns the AbortRequest frame to send when it was left
        before it ended (a stream left early, a timeout, an interrupt), None when it ended or was already closed
        (finished, failed with an ErrorResponse, the server gone)."""
        req = self._open.pop(rid, None)
        if req is None or req.done:
            return None
        return encode_request(p.AbortRequest(rid))

    def open_rids(self) -> list[str]:
        """The rids still open (a client closing aborts each)."""
        return list(self._open)

    def completions(self, rid: str) -> int:
        """n of an open request. Raises KeyError when rid is not open."""
        return self._open[rid].n

    def finished(self, rid: str) -> bool:
        """True once every completion of rid had its last chunk taken by pop() (a control request: its reply).
        Raises KeyError when rid is not open."""
        return self._open[rid].done

    def deadline(self, now: float) -> float | None:
        """When a call starting now times out (None: never)."""
        if self.timeout is None:
            return None
        return now + self.timeout

    # ------------------------------------------------------------------ frames received
    def receive(self, frame: bytes, now: float) -> str | None:
        """Decodes one frame from the server, restarts the liveness clock and routes the reply to its request's
        inbox; returns that rid, or None when nothing was routed: a Heartbeat, a reply to a request no longer
        waited on (aborted, timed out), or an ErrorResponse with rid "" (the server read no rid in a frame: only a
        face's send_raw can send such a frame) that fails no request, since none can be told apart by it: it is
        logged at WARNING and dropped. Raises msgspec.DecodeError for a frame that is no ServerMessage."""
        msg = _decoder.decode(frame)
        self.last_heard = now
        if isinstance(msg, p.Heartbeat):
            return None
        if isinstance(msg, p.ErrorResponse) and msg.rid == "":
            logger.warning(
                "%s rejected a frame it could not attribute to a request: [%s] %s", self.endpoint, msg.code, msg.message
            )
            return None
        req = self._open.get(msg.rid)
        if req is None:
            return None
        req.inbox.append(msg)
        return msg.rid

    def lost(self, reason: str) -> list[str]:
        """The face saw the connection to the server close (the server process is gone: its replies, and the
        requests it held, are lost): every open request fails with ServerGoneError(reason) once the replies already
        routed to it are taken. Returns their rids (the face wakes their callers). O(open)."""
        for req in self._open.values():
            req.lost = reason
        return list(self._open)

    def pop(self, rid: str) -> Reply | None:
        """The next reply routed to rid (None: none waiting). A StreamChunk with finish_reason marks its completion
        finished; a control reply ends its request. Raises the ServerError of an ErrorResponse (rid is then closed:
        the server ended it), ServerGoneError once its connection was lost (rid closed) and KeyError when rid is not
        open."""
        req = self._open[rid]
        if not req.inbox:
            if req.lost is not None:
                self._open.pop(rid, None)
                raise ServerGoneError(rid, p.ERR_SERVER, req.lost)
            return None
        msg = req.inbox.popleft()
        if isinstance(msg, p.ErrorResponse):
            self._open.pop(rid, None)
            raise error_from_response(msg)
        if not isinstance(msg, p.StreamChunk):
            req.finished.add(0)
        elif msg.finish_reason is not None:
            req.finished.add(msg.index)
        return msg

    def wait_s(self, rid: str, deadline: float | None, now: float) -> float:
        """Judges a call waiting on rid with nothing in its inbox: seconds the face may wait for a frame before
        judging again (until the first clock is due, at most JUDGE_EVERY_S). The face must first read the frames
        already waiting in its socket: the liveness clock measures the server's silence, not the caller's.
        Raises RequestTimeout at or past deadline (rid stays open: close() returns its AbortRequest), or
        ServerGoneError after more than liveness_s seconds since the last frame (rid is closed: nobody is there to
        abort it)."""
        if deadline is not None and now >= deadline:
            raise RequestTimeout(f"request {rid} got no answer within {self.timeout} s")
        due = now + JUDGE_EVERY_S
        if deadline is not None:
            due = min(due, deadline)
        liveness = self.liveness_s
        if liveness is not None:
            if now - self.last_heard > liveness:
                self._open.pop(rid, None)
                raise ServerGoneError(
                    rid,
                    p.ERR_SERVER,
                    f"nothing from {self.endpoint} for {liveness} s, not even a heartbeat: the server is gone",
                )
            due = min(due, self.last_heard + liveness)
        return max(0.0, due - now)


class CoreSettings:
    """What both faces (Client, AsyncClient) expose of the ClientCore they are given: its endpoint, and its timeout
    and liveness_s, settable."""

    def __init__(self, core: ClientCore) -> None:
        self._core = core

    @property
    def endpoint(self) -> str:
        return self._core.endpoint

    @property
    def timeout(self) -> float | None:
        """Seconds a call may wait (None: forever); settable, read when a call starts."""
        return self._core.timeout

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        self._core.timeout = seconds

    @property
    def liveness_s(self) -> float | None:
        """Seconds of server silence that mean it is gone (None: never); settable."""
        return self._core.liveness_s

    @liveness_s.setter
    def liveness_s(self, seconds: float | None) -> None:
        self._core.liveness_s = seconds
