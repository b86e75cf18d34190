"""ClientFrontend: heartbeats exactly the waiting clients, and a send to a vanished client calls on_gone once."""

from __future__ import annotations

import msgspec
import zmq

from runtime import protocol as p
from runtime.serve.frontend import ClientFrontend


def test_heartbeats_waiting_clients_and_reports_gone_ones():
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.bind("inproc://frontend")
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.IDENTITY, b"c1")
        client.connect("inproc://frontend")
        client.send(b"hello")
        assert router.recv_multipart() == [b"c1", b"hello"]
        gone: list[bytes] = []
        front = ClientFrontend(gone.append, heartbeat_s=0.25, socket=router)
        front.waiting(b"c1", now=100.0)
        front.heartbeat([b"c1"], now=100.1)  # not yet due
        assert not client.poll(50)
        front.heartbeat([b"c1"], now=100.3)
        assert msgspec.msgpack.decode(client.recv(), type=p.ServerMessage) == p.Heartbeat()
        front.heartbeat([], now=200.0)  # no longer waiting: forgotten, nothing sent
        assert front.last_sent == {} and not client.poll(50)
        assert front.send(b"nobody", p.Heartbeat()) is False
        assert gone == [b"nobody"]
    finally:
        ctx.destroy(linger=0)
