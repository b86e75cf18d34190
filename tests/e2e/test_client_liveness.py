"""The client tells a dead server from a slow one: silence (no frame, not even a heartbeat) for liveness_s seconds
raises ServerGoneError, while heartbeats keep a slow request waiting. A fake server on a ROUTER socket plays both."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import zmq

from runtime import protocol as p
from runtime.client import AsyncClient, Client, ServerGoneError


class FakeServer(threading.Thread):
    """Receives one request; sends `heartbeats` Heartbeats 0.1 s apart, then (if answer) a HealthResponse."""

    def __init__(self, heartbeats: int, answer: bool) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.heartbeats, self.answer = heartbeats, answer

    def run(self) -> None:
        identity, frame = self.sock.recv_multipart()
        req = msgspec.msgpack.decode(frame, type=p.ClientMessage)
        for _ in range(self.heartbeats):
            time.sleep(0.1)
            self.sock.send_multipart([identity, msgspec.msgpack.encode(p.Heartbeat())])
        if self.answer:
            self.sock.send_multipart([identity, msgspec.msgpack.encode(p.HealthResponse(req.rid, "ok"))])
        time.sleep(1.0)
        self.sock.close(linger=0)
        self.ctx.term()


def test_silence_means_gone_and_heartbeats_mean_alive():
    silent = FakeServer(heartbeats=0, answer=False)
    silent.start()
    with Client(silent.endpoint, timeout=30.0, liveness_s=0.5) as c:
        start = time.monotonic()
        with pytest.raises(ServerGoneError, match="not even a heartbeat"):
            c.health()
        assert time.monotonic() - start < 5.0  # not the 30 s timeout
    slow = FakeServer(heartbeats=12, answer=True)  # 1.2 s of heartbeats, more than liveness_s
    slow.start()
    with Client(slow.endpoint, timeout=30.0, liveness_s=0.5) as c:
        assert c.health() == "ok"
    silent.join(5), slow.join(5)


def test_async_client_silence_means_gone_and_heartbeats_mean_alive():
    async def main() -> None:
        silent = FakeServer(heartbeats=0, answer=False)
        silent.start()
        async with AsyncClient(silent.endpoint, timeout=30.0, liveness_s=0.5) as ac:
            with pytest.raises(ServerGoneError):
                await ac.health()
        slow = FakeServer(heartbeats=12, answer=True)
        slow.start()
        async with AsyncClient(slow.endpoint, timeout=30.0, liveness_s=0.5) as ac:
            assert await ac.health() == "ok"
        silent.join(5), slow.join(5)

    asyncio.run(main())
