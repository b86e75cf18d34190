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
    on_ready: Callable[[int], None] | None = None
    exposure: ExposureLimits = field(default_factory=ExposureLimits)

    @property
    def model_name(self) -> str:
        """The name /v1/models lists and responses carry."""
        return self.served_model_name or self.model
