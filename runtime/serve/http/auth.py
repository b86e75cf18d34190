"""API keys: with --api-key KEY (or RADIXSERVE_API_KEY) every route under /v1 needs `Authorization: Bearer KEY`, as
vLLM guards them; /health, /metrics, /tokenize and /detokenize stay open (probes and scrapers carry no key), and so
do CORS preflights (OPTIONS: a browser sends them without credentials).

A pure ASGI middleware (no per-request objects beyond the header scan); the key is compared in constant time
(hmac.compare_digest over the whole header value), so the answer's timing does not tell how much of a guess was right.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.serve.http.errors import OpenAIError
from runtime.serve.http.request_id import log_rejected

GUARDED_PREFIX = "/v1"


def guarded(scope: Scope) -> bool:
    """Whether an HTTP request needs the key: a path of /v1 or under it, any method but OPTIONS."""
    path = scope["path"]
    under = path == GUARDED_PREFIX or path.startswith(GUARDED_PREFIX + "/")
    return under and scope["method"] != "OPTIONS"


class ApiKeyMiddleware:
    """Answers 401 authentication_error (code invalid_api_key) to a guarded HTTP request without the right bearer
    key, logging the rejection; passes everything else (lifespan, open routes, requests with the key) to app."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = b"Bearer " + api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not guarded(scope) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        missing = not any(name == b"authorization" for name, _ in scope["headers"])
        reason = "no Authorization header" if missing else "the API key is not valid"
        error = OpenAIError(
            401, "authentication_error", f"{reason}: send 'Authorization: Bearer <api key>'", None, "invalid_api_key"
        )
        log_rejected(scope, error.status, error.message)
        await error.response()(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False
