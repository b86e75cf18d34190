"""HttpConfig: the settings of one HTTP server process (re-exported by runtime.serve.http.server)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.serve.http.exposure import ExposureLimits

MAX_BODY_BYTES = 8 * 2**20  # default request body limit (bytes): larger bodies get 413


@dataclass
class HttpConfig:
    """Settings of the HTTP server.

    backend: the radixserve public ZeroMQ endpoint it is a client of, e.g. "tcp://127.0.0.1:5557".
    host / port: where it listens (port 0: a free port, reported by the ready line and on_ready).
    api_key: when set, every route but /health needs `Authorization: Bearer <api_key>` (main() also reads
        RADIXSERVE_API_KEY).
    model: the model argument of the backend ("smollm2", a folder, a .gguf file): /v1/models lists it as the model's
        root (nothing is loaded from it: /tokenize, /detokenize and the token texts of logprobs come from the
        backend). served_model_name: the name /v1/models lists (None: model); a request may name either.
    max_body_bytes: largest request body (bytes); a larger one is answered 413 before it is read in full.
    health_timeout_s: seconds a health probe of the backend may take before /health answers 503.
    max_model_len: the backend's context limit in tokens, shown on the model cards (None: not known here).
    allowed_origins: origins CORS allows (("*",): any); empty: no CORS headers, preflights are 405.
    max_queued_requests: completion requests that may wait for a running slot (admission.py): at most
        max_running_requests + max_queued_requests are in flight in this process, one more is a 429 (None: no limit).
    max_running_requests: the backend's running slots (its --max-running-requests), for the limit above.
    shutdown_timeout_s: on SIGTERM, seconds the requests in flight get to finish (new ones: 503) before the server
        stops (drain.py).
    tool_call_parser: how tool calls are read in chat answers (runtime.text.tool_parsers.TOOL_PARSERS).
    on_ready: called with the bound port once the server listens and the backend answered a health probe.
    exposure: the connection limits (header timeout, keep-alive, connection cap, header size and count):
        runtime.serve.http.exposure.
    """

    backend: str = "tcp://127.0.0.1:5557"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model: str = "smollm2"
    served_model_name: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    health_timeout_s: float = 5.0
    max_model_len: int | None = None
    allowed_origins: tuple[str, ...] = ()
    max_queued_requests: int | None = None
    max_running_requests: int = 64
    shutdown_timeout_s: float = 30.0
    tool_call_parser: str = "hermes"
    on_ready: Callable[[int], None] | None = None
    exposure: ExposureLimits = field(default_factory=ExposureLimits)

    @property
    def model_name(self) -> str:
        """The name /v1/models lists and responses carry."""
        return self.served_model_name or self.model


def parse_origins(origins: str | None) -> tuple[str, ...]:
    """The origins of a comma-separated --allowed-origins value (None: none)."""
    if origins is None:
        return ()
    return tuple(o.strip() for o in origins.split(",") if o.strip())
