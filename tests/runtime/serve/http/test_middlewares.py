"""The HTTP server's pure ASGI middlewares in process, over a stub app that holds each request until released: the
request id (X-Request-Id honoured when valid, echoed, a backend rid of its own), the drain (503 once started, done
when nothing is in flight or at the deadline), admission (429 with Retry-After over the limit, the slot freed when
a request ends) and the API key on /v1 only. No sockets, no model (well under a second)."""

from __future__ import annotations

import asyncio
import json
import re
import time

from runtime.serve.http.admission import AdmissionMiddleware
from runtime.serve.http.auth import ApiKeyMiddleware
from runtime.serve.http.drain import Drain, DrainMiddleware
from runtime.serve.http.request_id import RequestIdMiddleware, backend_rid


class HeldApp:
    """An ASGI app answering 200 {"rid": backend_rid} once `release` is set; counts the requests it saw."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.seen = 0

    async def __call__(self, scope, receive, send) -> None:
        self.seen += 1
        await self.release.wait()
        body = json.dumps({"rid": backend_rid(scope)}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


async def call(app, path: str = "/v1/completions", method: str = "POST", headers: dict | None = None):
    """(status, headers dict, body) of one request through app."""
    sent: list[dict] = []
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def test_request_id_is_the_clients_when_valid_and_always_echoed():
    async def go():
        inner = HeldApp()
        inner.release.set()
        app = RequestIdMiddleware(inner)
        status, headers, body = await call(app, headers={"X-Request-Id": "job-1.a:b"})
        assert (status, headers["x-request-id"]) == (200, "job-1.a:b")
        assert re.fullmatch(r"job-1\.a:b-[0-9a-f]{8}", json.loads(body)["rid"])  # unique per request
        for bad in ("has space", "x" * 129, "é"):
            _, headers, body = await call(app, headers={"X-Request-Id": bad})
            assert re.fullmatch(r"[0-9a-f]{32}", headers["x-request-id"])
            assert json.loads(body)["rid"] == headers["x-request-id"]

    asyncio.run(go())


def test_drain_answers_503_once_started_and_is_done_when_nothing_is_in_flight():
    async def go():
        inner = HeldApp()
        drain = Drain(timeout_s=30.0)
        app = DrainMiddleware(inner, drain)
        held = asyncio.ensure_future(call(app))
        while drain.in_flight == 0:
            await asyncio.sleep(0)
        drain.start()
        assert not drain.done()
        status, _, body = await call(app, "/health", "GET")
        assert status == 503 and json.loads(body)["error"]["code"] == "backend_unavailable"
        assert inner.seen == 1
        inner.release.set()
        assert (await held)[0] == 200  # the request in flight finished
        assert (drain.in_flight, drain.done()) == (0, True)

    asyncio.run(go())


def test_drain_is_done_at_its_deadline_whatever_is_in_flight():
    drain = Drain(timeout_s=0.0)
    drain.in_flight = 3
    assert not drain.done()  # not draining yet
    drain.start()
    time.sleep(0.001)
    assert drain.done()


def test_admission_answers_429_with_retry_after_over_the_limit_and_frees_slots():
    async def go():
        inner = HeldApp()
        app = AdmissionMiddleware(inner, limit=2)
        held = [asyncio.ensure_future(call(app)) for _ in range(2)]
        while app.in_flight < 2:
            await asyncio.sleep(0)
        status, headers, body = await call(app, "/v1/chat/completions")
        assert (status, headers["retry-after"]) == (429, "1")
        assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
        inner.release.set()
        status, _, _ = await call(app, "/v1/models", "GET")  # other routes are never counted
        assert status == 200
        assert [(await h)[0] for h in held] == [200, 200]
        assert app.in_flight == 0
        assert (await call(app))[0] == 200

    asyncio.run(go())


def test_the_api_key_guards_v1_only_and_lets_preflights_through():
    async def go():
        inner = HeldApp()
        inner.release.set()
        app = ApiKeyMiddleware(inner, api_key="k")
        assert (await call(app, "/v1/models", "GET"))[0] == 401
        assert (await call(app, "/v1", "GET"))[0] == 401
        assert (await call(app, "/v1/models", "GET", {"Authorization": "Bearer k"}))[0] == 200
        for path, method in (("/health", "GET"), ("/metrics", "GET"), ("/tokenize", "POST"), ("/v1x", "GET")):
            assert (await call(app, path, method))[0] == 200, path
        assert (await call(app, "/v1/chat/completions", "OPTIONS"))[0] == 200

    asyncio.run(go())
