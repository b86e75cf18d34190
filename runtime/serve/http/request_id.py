"""The request id of every HTTP request, and the one log line of every rejected request.

A client's `X-Request-Id` header is used as the request id when it is valid (1 to MAX_REQUEST_ID_CHARS characters of
letters, digits and `._:-`, as the ids vLLM and load balancers send); otherwise the server makes one (32 hex). The id
is echoed as `X-Request-Id` on every answer, names the answer (`chatcmpl-<id>`, `cmpl-<id>`) and starts the backend
request's rid (backend_rid), and each rejected request (an error answer, before or during its stream) is logged
once, at WARNING, with its status, id and reason (log_rejected).
"""

from __future__ import annotations

import logging
import re
import secrets
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 128
HEADER = b"x-request-id"
_VALID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_REQUEST_ID_CHARS}}}")


def request_id_of(scope: Scope) -> str:
    """The request id RequestIdMiddleware gave this request ("-" outside the middleware, e.g. in unit tests)."""
    return scope.get("state", {}).get("request_id", "-")


def backend_rid(scope: Scope) -> str:
    """The rid of the request's backend GenerateRequest: the request id, with 8 random hex characters appended
    when the client chose the id (two clients may send the same X-Request-Id at once; backend rids must differ)."""
    state: dict[str, Any] = scope.get("state", {})
    rid = state.get("request_id") or uuid.uuid4().hex
    if state.get("request_id_from_client"):
        return f"{rid}-{secrets.token_hex(4)}"
    return rid


def log_rejected(scope: Scope, status: int, reason: str) -> None:
    """The one log line of a rejected request: method, path, status, request id and reason (cut to 300 chars)."""
    logger.warning(
        "rejected %s %s: status %d, request id %s: %s",
        scope.get("method", "-"),
        scope.get("path", "-"),
        status,
        request_id_of(scope),
        reason[:300],
    )


class RequestIdMiddleware:
    """Gives each HTTP request its id (scope["state"]["request_id"]; request_id_from_client tells whether it came
    from the header) and adds `X-Request-Id: <id>` to its answer's headers. Pure ASGI: no per-request task."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = None
        for name, value in scope["headers"]:
            if name == HEADER:
                given = value.decode("latin-1")
                break
        from_client = given is not None and _VALID.fullmatch(given) is not None
        rid = given if from_client and given is not None else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        state["request_id_from_client"] = from_client
        header = (HEADER, rid.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)
