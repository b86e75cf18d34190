"""In-process ZeroMQ links for the tests of the processes' servers (the `ctx` fixture is in conftest.py): PUSH/PULL
pairs over inproc, and reading every message a PULL socket has."""

from __future__ import annotations

import msgspec
import zmq


def link(ctx: zmq.Context, name: str) -> tuple[zmq.Socket, zmq.Socket]:
    """(push, pull) of an inproc link."""
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    pull.bind(f"inproc://{name}")
    push.connect(f"inproc://{name}")
    return push, pull


def drain(pull: zmq.Socket, msg_type) -> list:
    """Every message pull has within 50 ms of the last, decoded as msg_type."""
    out = []
    while pull.poll(50):
        out.append(msgspec.msgpack.decode(pull.recv(), type=msg_type))
    return out
