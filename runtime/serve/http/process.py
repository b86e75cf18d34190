"""The HTTP process of a launcher (role "http"): the OpenAI-compatible server of runtime.serve.http in front of the
public ZeroMQ endpoint, started once the tokenizer is ready (runtime.serve.launch, router.launch).

The API key never travels on a command line (a child's ChildSpec JSON is visible in `ps`): the launcher passes it in
the child's environment as RADIXSERVE_API_KEY, which is also the user's way to set it.
"""

from __future__ import annotations

import errno
import logging
import os
import socket

import zmq

from runtime import protocol as p
from runtime.serve.process import ChildSpec, StartupError, report, report_failure

logger = logging.getLogger(__name__)

API_KEY_ENV = "RADIXSERVE_API_KEY"
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "*": "127.0.0.1", "::": "::1"}


def api_key_from_env(api_key: str | None) -> str | None:
    """api_key if given, else RADIXSERVE_API_KEY from the environment (an empty value counts as unset)."""
    return api_key or os.environ.get(API_KEY_ENV) or None


def http_child_env(api_key: str | None) -> dict[str, str]:
    """The environment of an http child: this process's, with RADIXSERVE_API_KEY = api_key_from_env(api_key) (left
    out when that is None, so the child runs without a key)."""
    key = api_key_from_env(api_key)
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    if key is not None:
        env[API_KEY_ENV] = key
    return env


def connect_endpoint(endpoint: str) -> str:
    """The tcp:// endpoint a local client connects to for a bound endpoint: a wildcard host (0.0.0.0, ::, *) becomes
    the loopback address of its family. Raises ValueError for an endpoint that is not tcp://HOST:PORT."""
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        raise ValueError(f"not a tcp://HOST:PORT endpoint: {endpoint!r}")
    bare = host.strip("[]")
    if bare in _WILDCARDS:
        bare = _WILDCARDS[bare]
    return f"tcp://{url_host(bare)}:{port}"


def url_host(host: str) -> str:
    """host as it appears in a URL or endpoint: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def check_bindable(host: str, port: int) -> None:
    """Raises StartupError("cannot bind http_port HOST:PORT: <reason>") when a TCP socket cannot be bound there now
    (port in use, address not local), so a start-up failure names its cause in one line; port 0 always binds."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"cannot bind http_port {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise StartupError(f"cannot bind http_port {url_host(host)}:{port}: {reason}") from None


def run_http_process(spec: ChildSpec) -> None:
    """HTTP process entry: serves the OpenAI API on server_args.host:http_port in front of the public endpoint
    tcp://host:port of spec.server_args (the launcher puts the bound port there), reports ProcessReady("http", pid,
    "http://HOST:PORT") once it listens and the backend answered a health probe (the server's on_ready), and runs
    until SIGTERM: the launcher stopping it, or PR_SET_PDEATHSIG when the launcher dies.

    A start-up failure (the port cannot be bound, the server exits before it is ready) is reported as ProcessFailed
    with its cause on one line ("cannot bind http_port 127.0.0.1:8000: Address already in use"), then it returns."""
    args = spec.server_args
    ctx = zmq.Context()
    reports = ctx.socket(zmq.PUSH)
    reports.connect(spec.endpoints.launcher)
    ready: list[int] = []

    def on_ready(port: int) -> None:
        ready.append(port)
        report(reports, p.ProcessReady("http", os.getpid(), f"http://{url_host(args.host)}:{port}"))

    try:
        from runtime.serve.http.config import parse_origins
        from runtime.serve.http.server import HttpConfig, serve

        assert args.http_port is not None, "the http process needs server_args.http_port"
        check_bindable(args.host, args.http_port)
        config = HttpConfig(
            backend=connect_endpoint(f"tcp://{url_host(args.host)}:{args.port}"),
            host=args.host,
            port=args.http_port,
            api_key=api_key_from_env(None),
            model=args.model,
            served_model_name=args.served_model_name,
            max_body_bytes=args.max_message_bytes,
            max_model_len=args.max_model_len,
            allowed_origins=parse_origins(args.allowed_origins),
            max_queued_requests=args.max_queued_requests,
            max_running_requests=args.max_running_requests,
            shutdown_timeout_s=args.shutdown_timeout,
            tool_call_parser=args.tool_call_parser,
            on_ready=on_ready,
        )
        serve(config)
    except (Exception, SystemExit) as exc:  # uvicorn exits with status 1 when it cannot start
        if ready:
            raise
        if isinstance(exc, SystemExit):
            exc = StartupError(f"the HTTP server exited during start-up (status {exc.code})")
        elif isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
            exc = StartupError(
                f"cannot bind http_port {url_host(args.host)}:{args.http_port}: {os.strerror(exc.errno)}"
            )
        report_failure(ctx, reports, "http", exc)
        return
    ctx.destroy(linger=1000)
