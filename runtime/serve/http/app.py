"""The FastAPI app: the OpenAI routes in front of one radixserve backend.

Routes: POST /v1/chat/completions, POST /v1/completions (SSE when stream is true), GET /v1/models, GET /health (200
once the backend answers a health probe "ok", 503 before and whenever a probe fails), GET /metrics (Prometheus text,
the backend's stats fetched at scrape time; only this server's own series while the backend does not answer), POST
/tokenize, POST /detokenize (answered by the backend: this process loads no tokenizer, and logprobs name tokens by
the texts the backend sends). Errors: runtime.serve.http.errors. Bodies are read with a limit (Content-Length first,
then while reading: 413) and decoded with msgspec; answers are orjson bytes. A client that disconnects before its
answer is complete aborts its backend request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from runtime import protocol as p
from runtime.client import ClientError
from runtime.serve.http import openai_schema as schema
from runtime.serve.http import tokenization
from runtime.serve.http.auth import ApiKeyMiddleware
from runtime.serve.http.backend import Backend
from runtime.serve.http.config import HttpConfig
from runtime.serve.http.errors import INVALID, OpenAIError, from_exception, not_found, too_large, unavailable
from runtime.serve.http.generation import ClientDisconnected, Generation, race_disconnect
from runtime.serve.http.keepalive import start_first
from runtime.serve.http.metrics import CONTENT_TYPE, HttpMetrics
from runtime.serve.http.request_map import BackendRequest, chat_request, completion_request
from runtime.serve.http.responses import chat_response, completion_response
from runtime.serve.http.streaming import EventStream, StreamContext, chat_events, completion_events

logger = logging.getLogger(__name__)

JSON = "application/json"


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type=JSON)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most limit bytes. Raises OpenAIError 413 on a Content-Length over limit (before reading)
    or once more than limit bytes arrived; ClientDisconnect when the client leaves while sending."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large(int(length), limit)
    parts = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large(None, limit)
        parts.append(part)
    return b"".join(parts)


class Routes:
    """The route handlers over one Backend and HttpMetrics."""

    def __init__(self, config: HttpConfig, metrics: HttpMetrics, backend: Backend) -> None:
        self.config = config
        self.metrics = metrics
        self.backend = backend
        self.created = int(time.time())

    def check_model(self, model: str | None) -> None:
        """Raises OpenAIError 404 model_not_found unless model is None, the served name or the model argument."""
        if model is not None and model not in (self.config.model_name, self.config.model):
            raise not_found(
                f"the model {model[:100]!r} does not exist; this server serves {self.config.model_name!r}",
                "model_not_found",
                "model",
            )

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, schema.ChatCompletionRequest)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, schema.CompletionRequest)

    async def _complete(self, request: Request, cls: type[Any]) -> Response:
        arrival = time.perf_counter()
        client = self.backend.require_ready()
        req = schema.decode(await read_body(request, self.config.max_body_bytes), cls)
        self.check_model(req.model)
        chat = cls is schema.ChatCompletionRequest
        rid = uuid.uuid4().hex  # the answer's id and the backend request's rid
        if chat:
            backend_req = chat_request(req, rid)
        else:
            backend_req = completion_request(req, rid)
        gen = Generation(client, backend_req, self.metrics, arrival)
        created = int(time.time())
        model = self.config.model_name
        try:
            if req.stream:
                first = await start_first(gen, request.receive)  # headers within KEEPALIVE_S (keepalive.py)
                return self._event_stream(chat, rid, created, backend_req, gen, first)
            choices = await race_disconnect(gen.collect(), request.receive)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it: the client is gone, its request aborted
        except ClientError as exc:
            raise from_exception(exc, backend_req.param_names, backend_req.prompt_param) from None
        if chat:
            body = chat_response(rid, created, model, choices, gen.usage())
        else:
            body = completion_response(rid, created, model, choices, gen.usage())
        return _json(body)

    def _event_stream(
        self,
        chat: bool,
        rid: str,
        created: int,
        backend_req: BackendRequest,
        gen: Generation,
        first: asyncio.Task[p.StreamChunk],
    ) -> EventStream:
        """The SSE answer of a streamed request (first: its first backend chunk's task, done or not yet)."""
        model = self.config.model_name
        logprobs = backend_req.sampling_params.logprobs is not None
        usage = backend_req.include_usage
        if chat:
            ctx = StreamContext(f"chatcmpl-{rid}", "chat.completion.chunk", created, model, logprobs, usage)
            return EventStream(chat_events(gen, first, ctx))
        ctx = StreamContext(f"cmpl-{rid}", "text_completion", created, model, logprobs, usage)
        return EventStream(completion_events(gen, first, ctx))

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "radixserve",
            "root": self.config.model,
        }
        return _json({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        if self.backend.client is None:
            raise unavailable("the server is starting")
        problem = await self.backend.probe()
        if problem is not None:
            raise unavailable(problem)
        return _json({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        """The exposition with the backend's stats of now; without them (the backend not ready, gone or too slow)
        only the series of this server's own requests, so their counters survive a backend outage."""
        try:
            stats = await self.backend.stats()
        except OpenAIError as exc:
            logger.warning("/metrics without the backend's series: %s", exc.message)
            stats = None
        return Response(self.metrics.render(stats), media_type=CONTENT_TYPE)

    async def tokenize(self, request: Request) -> Response:
        req = schema.decode(await read_body(request, self.config.max_body_bytes), schema.TokenizeRequest)
        self.check_model(req.model)
        return _json(await tokenization.tokenize(self.backend.require_ready(), req))

    async def detokenize(self, request: Request) -> Response:
        req = schema.decode(await read_body(request, self.config.max_body_bytes), schema.DetokenizeRequest)
        self.check_model(req.model)
        return _json(await tokenization.detokenize(self.backend.require_ready(), req))


async def _openai_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return not_found(f"no route {request.method} {request.url.path}").response()
    code = "method_not_allowed" if exc.status_code == 405 else None
    return OpenAIError(
        exc.status_code, INVALID, f"{request.method} {request.url.path}: {exc.detail}", None, code
    ).response()


async def _disconnected(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)


def build_app(config: HttpConfig, metrics: HttpMetrics) -> FastAPI:
    """The app serving config.backend; metrics: the process's HttpMetrics (observe() per finished completion,
    render() at /metrics). The backend link opens when the app starts (lifespan) and closes when it stops;
    app.state.backend is the Backend (its ready event is set once the backend answered a health probe)."""
    backend = Backend(config.backend, config.health_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.open()
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.backend = backend
    routes = Routes(config, metrics, backend)
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics_text, methods=["GET"])
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"])
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _disconnected)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    return app
