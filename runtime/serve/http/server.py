"""The HTTP server process: `python -m runtime.serve.http --backend tcp://127.0.0.1:5557 --port 8000`.

serve() runs the app of runtime.serve.http.app on uvicorn (uvloop, httptools) until SIGINT, or until SIGTERM's drain
ends (runtime.serve.http.drain: new requests 503, the ones in flight finish within --shutdown-timeout seconds).
Once the socket is bound and the backend answered a health probe "ok", it prints
`radixserve http ready at http://HOST:PORT` (the line launchers and tests wait for) and calls config.on_ready(port).
It fronts any radixserve public endpoint: a server (runtime.launch) or a router (router.launch).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator

import uvicorn
import uvloop

from runtime.serve.http.app import build_app
from runtime.serve.http.config import MAX_BODY_BYTES, HttpConfig, parse_origins
from runtime.serve.http.drain import Drain
from runtime.serve.http.exposure import (
    ExposedConfig,
    add_exposure_flags,
    connection_cap,
    exposure_limits,
    raise_fd_limit,
)
from runtime.serve.http.metrics import HttpMetrics
from runtime.text.tool_parsers import TOOL_PARSERS

__all__ = ["HttpConfig", "build_parser", "main", "serve"]

logger = logging.getLogger(__name__)

API_KEY_ENV = "RADIXSERVE_API_KEY"
GRACEFUL_SHUTDOWN_S = 5  # after SIGINT (or a drain's end), open streams get this long before they are cut
DRAIN_POLL_S = 0.05


class _Server(uvicorn.Server):
    """uvicorn's Server, but a signal only stops it (uvicorn re-raises the signal after shutdown, which would kill
    the process with it or raise KeyboardInterrupt): serve() returns normally instead. SIGINT stops it now (open
    streams get GRACEFUL_SHUTDOWN_S); SIGTERM starts the drain (drain.py) and _watch_drain stops it once nothing is
    in flight or the drain's deadline passed."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        original = {
            signal.SIGINT: signal.signal(signal.SIGINT, self.handle_exit),
            signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_sigterm),
        }
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        if not self.drain.draining:
            logger.info(
                "SIGTERM: draining %d requests in flight (%.0f s at most)", self.drain.in_flight, self.drain.timeout_s
            )
        self.drain.start()


async def _watch_drain(server: _Server) -> None:
    """Stops server once its drain is done (drain.Drain.done), polling every DRAIN_POLL_S."""
    while not server.drain.done():
        await asyncio.sleep(DRAIN_POLL_S)
    if server.drain.in_flight:
        logger.warning("drain deadline passed with %d requests in flight: stopping", server.drain.in_flight)
    server.should_exit = True


def url_host(host: str) -> str:
    """host as it appears in a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def _serve(config: HttpConfig) -> None:
    app = build_app(config, HttpMetrics(config.model_name))
    fd_limit = raise_fd_limit()
    max_connections = connection_cap(config.exposure, fd_limit)
    if max_connections < config.exposure.max_connections:
        logger.warning("at most %d connections: the file-descriptor limit is %d", max_connections, fd_limit)
    server = _Server(
        ExposedConfig(
            app,
            config.exposure,
            max_connections,
            host=config.host,
            port=config.port,
            loop="none",
            lifespan="on",
            access_log=False,
            log_level="warning",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        ),
        app.state.drain,
    )
    serving = asyncio.ensure_future(server.serve())
    ready = asyncio.ensure_future(_announce(server, app.state.backend.ready, config))
    watch = asyncio.ensure_future(_watch_drain(server))
    try:
        await serving
    finally:
        ready.cancel()
        watch.cancel()
        await asyncio.gather(ready, watch, return_exceptions=True)


async def _announce(server: uvicorn.Server, backend_ready: asyncio.Event, config: HttpConfig) -> None:
    """Prints the ready line and calls on_ready once uvicorn listens and the backend is ready."""
    while not server.started:
        await asyncio.sleep(0.01)
    await backend_ready.wait()
    port = server.servers[0].sockets[0].getsockname()[1]
    sys.stdout.write(f"radixserve http ready at http://{url_host(config.host)}:{port}\n")
    sys.stdout.flush()
    if config.on_ready is not None:
        config.on_ready(port)


def serve(config: HttpConfig) -> None:
    """Serves config until SIGINT / SIGTERM (then returns). Raises SystemExit(1) when the port cannot be bound
    (uvicorn's start-up failure)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(config))


def build_parser() -> argparse.ArgumentParser:
    """The CLI: --backend, --host, --port, --api-key, --model, --served-model-name, --max-body-bytes,
    --health-timeout-s, --max-model-len, --allowed-origins, --max-queued-requests, --max-running-requests,
    --shutdown-timeout, --tool-call-parser, --log-level, and the connection limits (exposure.add_exposure_flags)."""
    parser = argparse.ArgumentParser(
        prog="python -m runtime.serve.http",
        description="OpenAI-compatible HTTP server in front of a radixserve endpoint.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--backend", default="tcp://127.0.0.1:5557", help="the radixserve public ZeroMQ endpoint")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on (0: a free port)")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on all routes but /health (default: ${API_KEY_ENV})",
    )
    parser.add_argument("--model", default="smollm2", help="the backend's model (the name answers carry by default)")
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="largest request body (413 above)")
    parser.add_argument(
        "--health-timeout-s",
        type=float,
        default=5.0,
        help="seconds a health probe of the backend may take before /health answers 503",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="the backend's context limit, shown on the model cards"
    )
    parser.add_argument(
        "--allowed-origins", default=None, help="CORS: comma-separated origins allowed, '*' for any (default: no CORS)"
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="requests that may wait beyond --max-running-requests; one more is a 429 (default: no limit)",
    )
    parser.add_argument(
        "--max-running-requests", type=int, default=64, help="the backend's running slots (for --max-queued-requests)"
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds a SIGTERM gives the requests in flight to finish (new ones get 503) before the server stops",
    )
    parser.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=sorted(TOOL_PARSERS),
        help="how tool calls are read in chat answers (runtime.text.tool_parsers)",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_exposure_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI entry: serves until Ctrl-C / SIGTERM; returns the exit status (1 when the port cannot be bound)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        exposure = exposure_limits(ns)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = HttpConfig(
        backend=ns.backend,
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key or os.environ.get(API_KEY_ENV) or None,
        model=ns.model,
        served_model_name=ns.served_model_name,
        max_body_bytes=ns.max_body_bytes,
        health_timeout_s=ns.health_timeout_s,
        max_model_len=ns.max_model_len,
        allowed_origins=parse_origins(ns.allowed_origins),
        max_queued_requests=ns.max_queued_requests,
        max_running_requests=ns.max_running_requests,
        shutdown_timeout_s=ns.shutdown_timeout,
        tool_call_parser=ns.tool_call_parser,
        exposure=exposure,
    )
    try:
        serve(config)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0
