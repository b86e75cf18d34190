"""API keys: with --api-key KEY (or RADIXSERVE_API_KEY) every route but /health needs `Authorization: Bearer KEY`.

A pure ASGI middleware (no per-request objects beyond the header scan); the key is compared in constant time
(hmac.compare_digest over the whole header value), so the answer's timing does not tell how much of a guess was right.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.serve.http.errors import OpenAIError

OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    """Answers 401 authentication_error (code invalid_api_key) to an HTTP request without the right bearer key;
    passes everything else (lifespan, /health, requests with the key) to app unchanged."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = b"Bearer " + api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        missing = not any(name == b"authorization" for name, _ in scope["headers"])
        reason = "no Authorization header" if missing else "the API key is not valid"
        error = OpenAIError(
            401, "authentication_error", f"{reason}: send 'Authorization: Bearer <api key>'", None, "invalid_api_key"
        )
        await error.response()(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False
