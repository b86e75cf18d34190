"""The HTTP server's link to the radixserve backend: one shared AsyncClient (many requests multiplexed on one DEALER
socket, replies routed by rid) and the backend's readiness, learnt from health probes."""

from __future__ import annotations

import asyncio
import logging

from runtime import protocol as p
from runtime.client import AsyncClient, ClientError
from runtime.serve.http.errors import from_exception, unavailable

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.2  # between start-up health probes


class Backend:
    """The backend endpoint and its state. open() must run inside the event loop that serves (the AsyncClient's
    reader task lives there); close() aborts every request in flight.

    ready: set once a health probe answered "ok" (completion routes answer 503 before); it stays set, since a
    backend that is gone fails its requests with ServerGoneError (503) anyway. /health probes on every call."""

    def __init__(self, endpoint: str, health_timeout_s: float) -> None:
        self.endpoint = endpoint
        self.health_timeout_s = health_timeout_s
        self.client: AsyncClient | None = None
        self.ready = asyncio.Event()
        self._startup: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """Connects the AsyncClient (timeout None: an HTTP request runs as long as its client waits; liveness 15 s
        still fails requests to a vanished backend) and starts probing until the backend answers "ok"."""
        self.client = await AsyncClient(self.endpoint, timeout=None).__aenter__()
        self._startup = asyncio.get_running_loop().create_task(self._wait_ready())

    async def close(self) -> None:
        if self._startup is not None:
            self._startup.cancel()
            await asyncio.gather(self._startup, return_exceptions=True)
        if self.client is not None:
            await self.client.close()

    async def _wait_ready(self) -> None:
        while await self.probe() is not None:
            await asyncio.sleep(PROBE_INTERVAL_S)

    async def probe(self) -> str | None:
        """One health probe: None when the backend answered "ok" (ready is set then), else why not."""
        assert self.client is not None, "Backend.open() first"
        try:
            status = await asyncio.wait_for(self.client.health(), self.health_timeout_s)
        except TimeoutError:
            return f"the backend at {self.endpoint} did not answer a health probe within {self.health_timeout_s} s"
        except ClientError as exc:
            return f"the backend at {self.endpoint} is not healthy: {exc}"
        if status != "ok":
            return f"the backend at {self.endpoint} reports {status!r}"
        self.ready.set()
        return None

    def require_ready(self) -> AsyncClient:
        """The client, once the backend was seen ready; raises OpenAIError 503 before."""
        if not self.ready.is_set() or self.client is None:
            raise unavailable(f"the backend at {self.endpoint} is not ready yet")
        return self.client

    async def stats(self) -> p.ServerStats:
        """Fresh ServerStats from the backend; raises OpenAIError 503 when it does not answer in time."""
        client = self.require_ready()
        try:
            return await asyncio.wait_for(client.stats(), self.health_timeout_s)
        except TimeoutError:
            raise unavailable(
                f"the backend at {self.endpoint} did not answer a stats request within {self.health_timeout_s} s"
            ) from None
        except ClientError as exc:
            raise from_exception(exc, {}, "") from None
