"""The FastAPI app: the OpenAI routes in front of one radixserve backend.

Routes: POST /v1/chat/completions, POST /v1/completions (SSE when stream is true), GET /v1/models, GET
/v1/models/{id} (404 model_not_found for another id), GET /health (200
once the backend answers a health probe "ok", 503 before and whenever a probe fails), GET /metrics (Prometheus text,
the backend's stats fetched at scrape time; only this server's own series while the backend does not answer), POST
/tokenize, POST /detokenize (answered by the backend: this process loads no tokenizer, and logprobs name tokens by
the texts the backend sends). Errors: runtime.serve.http.errors. Bodies are read with a limit (Content-Length first,
then while reading: 413) and decoded with msgspec; answers are orjson bytes. A client that disconnects before its
answer is complete aborts its backend request. Every request gets an id (request_id.py: X-Request-Id honoured and
echoed) and every rejected one a log line; with config.allowed_origins, CORS (starlette's CORSMiddleware) answers
preflights and adds the Access-Control headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from runtime import protocol as p
from runtime.client import ClientError
from runtime.serve.http import openai_schema as schema
from runtime.serve.http import tokenization
from runtime.serve.http.admission import AdmissionMiddleware
from runtime.serve.http.auth import ApiKeyMiddleware
from runtime.serve.http.backend import Backend
from runtime.serve.http.config import HttpConfig
from runtime.serve.http.drain import Drain, DrainMiddleware
from runtime.serve.http.echo import StreamEcho, answer_prompt, echo_text
from runtime.serve.http.errors import INVALID, OpenAIError, from_exception, not_found, too_large, unavailable
from runtime.serve.http.generation import ClientDisconnected, Generation, race_disconnect
from runtime.serve.http.generation_group import AnyGeneration, GenerationGroup
from runtime.serve.http.keepalive import start_first
from runtime.serve.http.metrics import CONTENT_TYPE, HttpMetrics
from runtime.serve.http.request_id import RequestIdMiddleware, backend_rid, log_rejected, request_id_of
from runtime.serve.http.request_map import BackendRequest, chat_request, completion_requests
from runtime.serve.http.responses import chat_response, completion_response
from runtime.serve.http.streaming import EventStream, StreamContext, chat_events, completion_events
from runtime.text.tool_parsers import tool_parser_class

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
        self.tool_parser = tool_parser_class(config.tool_call_parser)

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
        rid = request_id_of(request.scope)  # the answer's id
        if chat:
            backend_reqs = [chat_request(req, backend_rid(request.scope), self.tool_parser)]
        else:
            backend_reqs = completion_requests(req, backend_rid(request.scope))
        backend_req = backend_reqs[0]
        gens = [Generation(client, b, self.metrics, arrival) for b in backend_reqs]
        gen: AnyGeneration = gens[0] if len(gens) == 1 else GenerationGroup(gens)
        created = int(time.time())
        model = self.config.model_name
        try:
            if req.stream:
                first = await start_first(gen, request.receive)  # headers within KEEPALIVE_S (keepalive.py)
                echo = None
                if backend_req.echo or backend_req.prompt_logprobs is not None:
                    text = await echo_text(backend_req, client) if backend_req.echo else ""
                    echo = StreamEcho(backend_req, gen.fold, text)
                return self._event_stream(chat, rid, created, backend_req, gen, first, request, echo)
            choices = await race_disconnect(gen.collect(), request.receive)
            if chat:
                body = chat_response(rid, created, model, choices, gen.usage(), backend_req.tools)
            else:
                body = completion_response(rid, created, model, choices, gen.usage())
            if backend_req.echo or backend_req.prompt_logprobs is not None:
                await answer_prompt(body, backend_req, gen.fold, client)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it: the client is gone, its request aborted
        except ClientError as exc:
            raise from_exception(exc, backend_req.param_names, backend_req.prompt_param) from None
        return _json(body)

    def _event_stream(
        self,
        chat: bool,
        rid: str,
        created: int,
        backend_req: BackendRequest,
        gen: AnyGeneration,
        first: asyncio.Task[p.StreamChunk],
        request: Request,
        echo: StreamEcho | None = None,
    ) -> EventStream:
        """The SSE answer of a streamed request (first: its first backend chunk's task, done or not yet; echo:
        completions' prompt)."""
        model = self.config.model_name
        logprobs = backend_req.sampling_params.logprobs is not None
        usage = backend_req.include_usage
        if chat:
            ctx = StreamContext(f"chatcmpl-{rid}", "chat.completion.chunk", created, model, logprobs, usage)
            ctx.scope = request.scope
            ctx.continuous_usage = backend_req.continuous_usage
            return EventStream(chat_events(gen, first, ctx, backend_req.tools))
        ctx = StreamContext(f"cmpl-{rid}", "text_completion", created, model, logprobs, usage)
        ctx.scope = request.scope
        ctx.continuous_usage = backend_req.continuous_usage
        return EventStream(completion_events(gen, first, ctx, echo))

    def card(self) -> dict[str, Any]:
        """The model card /v1/models lists: id (the served name), root (the model argument), max_model_len (the
        context limit in tokens, None when this process was not told it)."""
        return {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "radixserve",
            "root": self.config.model,
            "max_model_len": self.config.max_model_len,
        }

    async def models(self, request: Request) -> Response:
        return _json({"object": "list", "data": [self.card()]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model_id}: the card of the served model (by its served name or the model argument);
        404 model_not_found for any other id."""
        model_id = request.path_params["model_id"]
        self.check_model(model_id)
        return _json(self.card())

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
    log_rejected(request.scope, exc.status, exc.message)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        error = not_found(f"no route {request.method} {request.url.path}")
    else:
        code = "method_not_allowed" if exc.status_code == 405 else None
        error = OpenAIError(exc.status_code, INVALID, f"{request.method} {request.url.path}: {exc.detail}", None, code)
    log_rejected(request.scope, error.status, error.message)
    return error.response()


async def _disconnected(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)


def build_app(config: HttpConfig, metrics: HttpMetrics) -> FastAPI:
    """The app serving config.backend; metrics: the process's HttpMetrics (observe() per finished completion,
    render() at /metrics). The backend link opens when the app starts (lifespan) and closes when it stops;
    app.state.backend is the Backend (its ready event is set once the backend answered a health probe),
    app.state.drain the Drain a SIGTERM starts (server.py)."""
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
    app.state.drain = Drain(config.shutdown_timeout_s)
    routes = Routes(config, metrics, backend)
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", routes.model, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics_text, methods=["GET"])
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"])
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _disconnected)
    # add_middleware puts each one outside the ones before it: the request id, CORS, drain, the key, admission
    if config.max_queued_requests is not None:
        limit = config.max_running_requests + config.max_queued_requests
        app.add_middleware(AdmissionMiddleware, limit=limit)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    app.add_middleware(RequestIdMiddleware)
    return app
