"""The HTTP server process: `python -m runtime.serve.http --backend tcp://127.0.0.1:5557 --port 8000`.

serve() runs the app of runtime.serve.http.app on uvicorn (uvloop, httptools) until SIGINT / SIGTERM. Once the socket
is bound and the backend answered a health probe "ok", it prints `radixserve http ready at http://HOST:PORT` (the
line launchers and tests wait for) and calls config.on_ready(port). It fronts any radixserve public endpoint: a
server (runtime.launch) or a router (router.launch).
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
from runtime.serve.http.config import MAX_BODY_BYTES, HttpConfig
from runtime.serve.http.exposure import (
    ExposedConfig,
    add_exposure_flags,
    connection_cap,
    exposure_limits,
    raise_fd_limit,
)
from runtime.serve.http.metrics import HttpMetrics

__all__ = ["HttpConfig", "build_parser", "main", "serve"]

logger = logging.getLogger(__name__)

API_KEY_ENV = "RADIXSERVE_API_KEY"
GRACEFUL_SHUTDOWN_S = 5  # open streams get this long after SIGTERM before they are cut (and their requests aborted)


class _Server(uvicorn.Server):
    """uvicorn's Server, but a SIGINT / SIGTERM only stops it (uvicorn re-raises the signal after shutdown, which
    would kill the process with it or raise KeyboardInterrupt): serve() returns normally instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


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
        )
    )
    serving = asyncio.ensure_future(server.serve())
    ready = asyncio.ensure_future(_announce(server, app.state.backend.ready, config))
    try:
        await serving
    finally:
        ready.cancel()
        await asyncio.gather(ready, return_exceptions=True)


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
    --health-timeout-s, --log-level, and the connection limits (exposure.add_exposure_flags)."""
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
        exposure=exposure,
    )
    try:
        serve(config)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0
