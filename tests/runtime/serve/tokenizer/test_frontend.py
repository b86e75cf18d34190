"""ClientFrontend: heartbeats exactly the waiting clients, and a send to a vanished client calls on_gone once."""

from __future__ import annotations

import logging

import msgspec
import zmq

from runtime import protocol as p
from runtime.serve.tokenizer.frontend import ClientFrontend


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


def test_an_unreachable_client_is_logged_by_a_keyed_tag_never_by_its_identity(caplog):
    """Logging a raw identity leaked the ROUTER's auto-id counter (b"\\x00" + 4 bytes, +1 per connection), which let
    a client claim the next ids with explicit ROUTING_IDs and crash the process at the next ordinary connection."""
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.bind("inproc://frontend-log")
        identity = b"\x00\x6b\x8b\x45\xa3"  # the shape of a libzmq auto id
        gone: list[bytes] = []
        front = ClientFrontend(gone.append, 0.25, router)
        other = ClientFrontend(gone.append, 0.25, router)
        with caplog.at_level(logging.INFO, logger="runtime.serve.tokenizer.frontend"):
            assert front.send(identity, p.Heartbeat()) is False
        assert gone == [identity]
        [line] = [r.getMessage() for r in caplog.records]
        assert identity.hex() not in line and identity.hex()[2:] not in line and repr(identity) not in line
        assert line == f"client {front.tag(identity)} unreachable (Host unreachable); aborting its requests"
        tag = front.tag(identity)
        assert len(tag) == 8 and int(tag, 16) >= 0 and front.tag(identity) == tag  # 4 bytes as hex, stable
        assert other.tag(identity) != tag  # keyed per frontend (a chance of 2**-32 to collide)
        assert front.tag(b"\x00\x6b\x8b\x45\xa4") != tag
    finally:
        ctx.destroy(linger=0)
