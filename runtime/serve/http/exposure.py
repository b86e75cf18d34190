"""The HTTP server's front door under hostile connections: uvicorn's httptools protocol with the limits uvicorn lacks.

uvicorn (0.55, httptools) arms its keep-alive timer only after a response, has no header-read timeout, no header size
or count limit (llhttp hands every header to Python, however large), and its limit_concurrency answers 503 only once
a request's headers are complete, so connections that never finish their headers stay open until the process runs
out of file descriptors. ExposedHttpProtocol adds, per connection:

- a header-read timeout: a request's headers must be complete header_timeout_s after the connection opened or the
  request began (trickling bytes does not extend it); past it the connection is closed (408 when part of a request
  arrived, silently when nothing did). Idle keep-alive connections close after keep_alive_s (uvicorn's own timer).
- a cap on open connections, below the file-descriptor limit: at the cap a new connection takes the place of the
  connection idle longest (no request being answered: it never sent one, is still sending its headers, or waits
  between requests), which is closed; when every connection is answering a request, the new one gets a 503 at
  once. Idle or slow connections cannot keep a client (or /health) out.
- a header size and count limit: more than max_header_bytes before the headers are complete (request line
  included), or more than max_headers header fields, is a 431 and the connection is closed.

Every refusal is logged by class (header timeout, connection cap, headers too large / too many, invalid HTTP), at
most once per LOG_EVERY_S per class with the number refused since (RefusalLog). Errors carry the OpenAI error shape.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

logger = logging.getLogger(__name__)

LOG_EVERY_S = 10.0  # at most one log line per refusal class per this many seconds
FD_RESERVE = 64  # file descriptors kept back from max_connections: the backend's sockets, logs, the listener
REFUSED_LINGER_S = 1.0  # a refused connection is read (and its bytes dropped) this long after its answer, then closed
_QUIET = logging.getLogger("runtime.serve.http.exposure.uvicorn")  # uvicorn's per-request warnings, replaced by ours
_QUIET.setLevel(logging.ERROR)


@dataclass(frozen=True)
class ExposureLimits:
    """Connection limits of the HTTP server (each a flag of `python -m runtime.serve.http`).

    header_timeout_s: seconds from a connection's start (or a request's first byte) to its headers' end.
    keep_alive_s: seconds an idle keep-alive connection is kept between requests (uvicorn's timeout_keep_alive).
    max_connections: open connections at most (lowered at start to the file-descriptor limit less FD_RESERVE).
    max_header_bytes: bytes of a request's request line and headers at most; max_headers: header fields at most.
    """

    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_connections: int = 4096
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100


class RefusalLog:
    """Rate-limited log lines of refused connections, one per class: the first refusal of a class logs at once,
    later ones at most every every_s seconds, with the count since the last line. O(1) per refusal."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        self.every_s = every_s
        self.counts: dict[str, int] = {}  # class -> refused since the last line
        self.total: dict[str, int] = {}  # class -> refused since start
        self.last: dict[str, float] = {}

    def refused(self, kind: str, detail: str, now: float | None = None) -> None:
        """Counts one refusal of class kind (detail: the last one's cause) and logs when the class's line is due."""
        now = time.monotonic() if now is None else now
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.total[kind] = self.total.get(kind, 0) + 1
        if now - self.last.get(kind, -self.every_s) < self.every_s:
            return
        logger.warning(
            "refused %d connection(s) (%s) in the last %.0f s: %s", self.counts[kind], kind, self.every_s, detail
        )
        self.counts[kind] = 0
        self.last[kind] = now


REFUSALS = RefusalLog()  # the process's one log of refusals


def raise_fd_limit() -> int:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit (mutates the process); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(limits: ExposureLimits, fd_limit: int) -> int:
    """max_connections, lowered to fd_limit - FD_RESERVE (at least 1) so the cap binds before the fd limit does."""
    return max(1, min(limits.max_connections, fd_limit - FD_RESERVE))


def error_answer(status: int, message: str, code: str, close: bool = True) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-shaped JSON error body, `Connection: close`."""
    kind = "service_unavailable_error" if status == 503 else "invalid_request_error"
    body = orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})
    head = [
        STATUS_LINE[status],
        b"content-type: application/json\r\n",
        b"content-length: " + str(len(body)).encode() + b"\r\n",
    ]
    if close:
        head.append(b"connection: close\r\n")
    return b"".join([*head, b"\r\n", body])


class _HeadersRefused(Exception):
    """Raised from a parser callback: too many header fields (httptools wraps it in HttpParserCallbackError)."""


class ExposedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with ExposureLimits (config must be an ExposedConfig)."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any], _loop: Any = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits: ExposureLimits = config.limits
        self.max_connections: int = config.max_connections
        self.idle_connections: OrderedDict[ExposedHttpProtocol, None] = config.idle_connections
        self.logger = _QUIET
        self._header_timer: asyncio.TimerHandle | None = None
        self._headers_pending = True  # between a request's start and its headers' end (and on a fresh connection)
        self._header_bytes = 0  # bytes received while headers were pending (request line and headers)
        self._num_headers = 0
        self._parsed_bytes = 0  # bytes of this request's URL and headers the parser handed over
        self._refused: str | None = None  # why this connection is being refused (its bytes are dropped)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            detail = f"{self.max_connections} connections open (--max-connections)"
            victim = next(iter(self.idle_connections), None)
            if victim is None:
                self.connections.discard(self)
                REFUSALS.refused("connection cap", detail)
                message = f"the server holds its limit of {self.max_connections} connections; retry later"
                self._refuse("connection cap", error_answer(503, message, "too_many_connections"))
                return
            REFUSALS.refused("idle connection closed at the cap", detail)
            victim.close_idle()
        self.idle_connections[self] = None
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self.idle_connections.pop(self, None)
        super().connection_lost(exc)

    def close_idle(self) -> None:
        """Closes this idle connection to make room for a new one (at the connection cap)."""
        self._refused = "closed at the cap"
        self._cancel_header_timer()
        self._unset_keepalive_if_required()
        self.connections.discard(self)
        self.idle_connections.pop(self, None)
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._idle() and self._refused is None and not self.transport.is_closing():
            self.idle_connections[self] = None  # idle again, now the most recent

    def data_received(self, data: bytes) -> None:
        if self._refused is not None:
            return  # refused: read and dropped until closed
        if self._headers_pending:
            self._header_bytes += len(data)
        if self._header_timer is None and self._idle():
            self._arm_header_timer()  # bytes after a response: the next request began (or leading CRLFs)
        super().data_received(data)
        if self._refused is None and self._headers_pending and self._header_bytes > self.limits.max_header_bytes:
            self._headers_too_large(f"more than {self.limits.max_header_bytes} bytes of request line and headers")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._headers_pending = True
        self._num_headers = 0
        self._parsed_bytes = 0
        if self._header_timer is None:
            self._arm_header_timer()

    def on_url(self, url: bytes) -> None:
        self._parsed_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self.limits.max_headers:
            raise _HeadersRefused(f"more than {self.limits.max_headers} header fields")
        self._parsed_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if self._parsed_bytes > self.limits.max_header_bytes:
            raise _HeadersRefused(f"more than {self.limits.max_header_bytes} bytes of request line and headers")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._headers_pending = False
        self._header_bytes = 0
        self._cancel_header_timer()
        self.idle_connections.pop(self, None)
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a parse error: a 431 when our header limits raised it, else a 400 (JSON)."""
        error = self.parser_error
        if error is not None:
            self._headers_too_large(str(error))
            return
        REFUSALS.refused("invalid HTTP", msg)
        self._refuse("invalid HTTP", error_answer(400, msg, "invalid_http"))

    @property
    def parser_error(self) -> _HeadersRefused | None:
        """The _HeadersRefused the parse error in flight wraps, if any (read inside send_400_response)."""
        exc = sys.exc_info()[1]
        context = None if exc is None else exc.__context__
        return context if isinstance(context, _HeadersRefused) else None

    def _headers_too_large(self, detail: str) -> None:
        REFUSALS.refused("headers too large", detail)
        self._refuse(
            "headers too large", error_answer(431, f"request headers too large: {detail}", "headers_too_large")
        )

    def _refuse(self, why: str, answer: bytes) -> None:
        """Sends answer, half-closes, drops whatever else arrives and closes after REFUSED_LINGER_S (closing at once
        with unread bytes would reset the connection before the client read the answer)."""
        self._refused = why
        self._cancel_header_timer()
        self._unset_keepalive_if_required()
        self.connections.discard(self)
        self.idle_connections.pop(self, None)
        if self.transport.is_closing():
            return
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(REFUSED_LINGER_S, self.transport.close)

    def _idle(self) -> bool:
        """No request of this connection is being answered."""
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self._headers_pending or self.transport.is_closing() or not self._idle():
            return  # headers complete, or a request is being answered (a pipelined successor waits for it)
        timeout = self.limits.header_timeout_s
        REFUSALS.refused("header timeout", f"headers not complete within {timeout} s (--header-timeout-s)")
        if self._header_bytes == 0:
            self.close_idle()  # nothing was asked: nothing to answer
            return
        self._refuse("header timeout", error_answer(408, f"request headers not complete within {timeout} s", "timeout"))


def add_exposure_flags(parser: argparse.ArgumentParser) -> None:
    """--header-timeout-s, --keep-alive-s, --max-connections, --max-header-bytes, --max-headers (ExposureLimits)."""
    d = ExposureLimits()
    group = parser.add_argument_group("connection limits")
    group.add_argument(
        "--header-timeout-s", type=float, default=d.header_timeout_s, help="seconds for a request's headers to arrive"
    )
    group.add_argument("--keep-alive-s", type=float, default=d.keep_alive_s, help="seconds an idle connection is kept")
    group.add_argument(
        "--max-connections", type=int, default=d.max_connections, help="open connections at most (503 past it)"
    )
    group.add_argument(
        "--max-header-bytes", type=int, default=d.max_header_bytes, help="bytes of request line and headers (431)"
    )
    group.add_argument("--max-headers", type=int, default=d.max_headers, help="header fields per request (431)")


def exposure_limits(ns: argparse.Namespace) -> ExposureLimits:
    """The ExposureLimits of parsed add_exposure_flags flags. Raises ValueError naming a flag out of range."""
    limits = ExposureLimits(
        ns.header_timeout_s, ns.keep_alive_s, ns.max_connections, ns.max_header_bytes, ns.max_headers
    )
    for name, value in vars(limits).items():
        if value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    return limits


class ExposedConfig(uvicorn.Config):
    """uvicorn.Config serving with ExposedHttpProtocol under limits (keep_alive_s becomes timeout_keep_alive).
    max_connections: the cap in force (connection_cap of the process's fd limit). idle_connections: the server's
    connections that answer no request, oldest idle first (the next closed at the cap); O(1) per change."""

    def __init__(self, app: Any, limits: ExposureLimits, max_connections: int, **kwargs: Any) -> None:
        super().__init__(app, http=ExposedHttpProtocol, timeout_keep_alive=int(max(1, limits.keep_alive_s)), **kwargs)
        self.limits = limits
        self.max_connections = max_connections
        self.idle_connections: OrderedDict[Any, None] = OrderedDict()  # oldest idle first
