"""Admission control: a completion request over the limit is answered 429 at once instead of joining a queue that
grows without bound (--max-queued-requests).

Where requests queue: in the scheduler's waiting queue, not here. This process counts the completion requests it
has in flight (sent to the backend and not yet answered in full) and admits one only while fewer than
max_running_requests + max_queued_requests are: the backend runs up to max_running_requests of them and the rest,
at most max_queued_requests, wait for a running slot. A request with n > 1 counts once here (the scheduler runs its
n sequences together), and ZeroMQ clients of the same backend are not counted. Without a limit
(max_queued_requests None) the middleware is not installed.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.serve.http.errors import OpenAIError
from runtime.serve.http.request_id import log_rejected

COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
RETRY_AFTER_S = 1  # the Retry-After of a 429 (seconds): about the time a running request takes to free a slot


class AdmissionMiddleware:
    """Counts the completion requests in flight (in_flight) and answers 429 rate_limit_error, code
    rate_limit_exceeded, with `Retry-After: RETRY_AFTER_S` to one that would make them more than limit. O(1) per
    request; other routes pass untouched."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in COMPLETION_PATHS or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            error = OpenAIError(
                429,
                "rate_limit_error",
                f"the server has {self.in_flight} requests in flight, its limit: retry after {RETRY_AFTER_S} s",
                None,
                "rate_limit_exceeded",
            )
            log_rejected(scope, error.status, error.message)
            response = error.response()
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            await response(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
