"""Graceful drain: on SIGTERM the HTTP server stops admitting requests (503) and lets the ones in flight finish, up
to shutdown_timeout_s seconds, before it stops.

Drain is an ASGI middleware that counts every HTTP request in flight and, once start() was called, answers each new
one 503 (backend_unavailable, "the server is shutting down"; /health too, so a load balancer takes the server out).
server.py's signal handler calls start() on SIGTERM; its watcher stops uvicorn once idle() or the deadline passed.
Requests still running at the deadline are then cut by uvicorn's shutdown (their backend requests aborted).
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.serve.http.errors import unavailable
from runtime.serve.http.request_id import log_rejected


class Drain:
    """The process's drain state: in_flight (HTTP requests being answered), draining (start() was called) and the
    deadline (time.monotonic() seconds). Mutated from the event loop's thread only (the signal handler runs there)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.in_flight = 0
        self.draining = False
        self.deadline = float("inf")

    def start(self) -> None:
        """Stops admitting requests; the ones in flight get timeout_s seconds. A second call changes nothing."""
        if not self.draining:
            self.draining = True
            self.deadline = time.monotonic() + self.timeout_s

    def done(self) -> bool:
        """True once draining and nothing is in flight, or the deadline passed."""
        return self.draining and (self.in_flight == 0 or time.monotonic() >= self.deadline)


class DrainMiddleware:
    """Counts HTTP requests in drain.in_flight; answers 503 to those that arrive while drain.draining."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            error = unavailable("the server is shutting down")
            log_rejected(scope, error.status, error.message)
            await error.response()(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
