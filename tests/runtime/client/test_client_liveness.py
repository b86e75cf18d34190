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

pytestmark = pytest.mark.slow  # seconds per test: make test-fast leaves it out


class FakeServer(threading.Thread):
    """Receives one request; sends `heartbeats` Heartbeats 0.1 s apart, then (if answer) a HealthResponse."""

    def __init__(self, heartbeats: int, answer: bool) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.heartbeats = heartbeats
        self.answer = answer

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


class ScriptedServer(threading.Thread):
    """Receives one request, then sends script(rid): (seconds to wait first, message) pairs; then stays silent
    until stop()."""

    def __init__(self, script) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.script = script
        self.done = threading.Event()

    def stop(self) -> None:
        self.done.set()
        self.join(10)

    def run(self) -> None:
        identity, frame = self.sock.recv_multipart()
        for delay, msg in self.script(msgspec.msgpack.decode(frame, type=p.ClientMessage).rid):
            time.sleep(delay)
            self.sock.send_multipart([identity, msgspec.msgpack.encode(msg)])
        self.done.wait(10)  # silent, but the socket stays open until the client has read everything
        self.sock.close(linger=0)
        self.ctx.term()


def chunk(rid: str, token: int, last: bool) -> p.StreamChunk:
    return p.StreamChunk(
        rid=rid,
        text=chr(ord("a") + token),
        token_ids=[token],
        finish_reason="stop" if last else None,
        usage=p.Usage(2, 0, token + 1) if last else None,
    )


def test_an_answer_waiting_in_the_socket_is_read_after_the_caller_slept_past_liveness():
    """`rid = c.submit(...); time.sleep(16); c.result(rid)` failed at once with ServerGoneError while the answer sat in
    the socket: the liveness clock measures the server's silence, not the caller's."""
    server = ScriptedServer(lambda rid: [(0.0, chunk(rid, 0, False)), (0.0, chunk(rid, 1, True))])
    server.start()
    with Client(server.endpoint, timeout=30.0, liveness_s=0.5) as c:
        rid = c.submit(prompt="Hi", max_tokens=2)
        time.sleep(1.0)  # twice liveness_s
        result = c.result(rid)
        assert (result.text, result.token_ids, result.finish_reason) == ("ab", [0, 1], "stop")
    server.stop()


def test_a_slow_stream_consumer_reads_the_heartbeats_that_arrived_meanwhile_and_silence_is_still_gone():
    heartbeats = [(0.1, p.Heartbeat())] * 12  # 1.2 s of heartbeats between the two chunks
    slow = ScriptedServer(lambda rid: [(0.0, chunk(rid, 0, False)), *heartbeats, (0.1, chunk(rid, 1, True))])
    slow.start()
    with Client(slow.endpoint, timeout=30.0, liveness_s=0.5) as c:
        texts = []
        for piece in c.stream(prompt="Hi", max_tokens=2):
            texts.append(piece.text)
            time.sleep(1.0 if piece.token_ids == [0] else 0.0)  # slower than liveness_s
        assert texts == ["a", "b"]
    slow.stop()
    silent = ScriptedServer(lambda rid: [(0.0, chunk(rid, 0, False))])  # then nothing, not even a heartbeat
    silent.start()
    with Client(silent.endpoint, timeout=30.0, liveness_s=0.5) as c:
        stream = c.stream(prompt="Hi", max_tokens=2)
        assert next(stream).text == "a"
        time.sleep(1.0)
        with pytest.raises(ServerGoneError, match="not even a heartbeat"):
            next(stream)
    silent.stop()
