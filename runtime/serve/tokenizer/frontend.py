"""ClientFrontend: the client side of a public ROUTER endpoint, shared by the tokenizer process and the router.

It sends replies to client identities without blocking, notices a vanished client (a send that fails under
ROUTER_MANDATORY or a full queue) and heartbeats every client that is waiting, so a client that hears nothing for its
liveness interval knows the server is gone (runtime.client.ServerGoneError).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable

import msgspec
import zmq

from runtime import protocol as p

logger = logging.getLogger(__name__)


class ClientFrontend:
    """Replies and heartbeats to the clients of one ROUTER socket.

    on_gone(identity): called once when a send to identity fails; the owner aborts that client's requests.
    heartbeat_s: a waiting client that was sent nothing for this many seconds gets a Heartbeat.
    socket: the ROUTER (set by the owner, possibly after construction). Mutates: last_sent (identity -> monotonic
    time of the last frame sent, for the waiting clients only).

    A client identity is never logged or sent anywhere, only tag(identity), a keyed hash: libzmq's ROUTER gives each
    client without its own ROUTING_ID the id b"\\x00" + a 32-bit counter (random start, +1 per connection), and a
    client that knows the counter can connect DEALERs with explicit ROUTING_IDs equal to the next auto ids; the next
    ordinary client then gets a colliding id and libzmq aborts the process (libzmq 4.3.5 and master, router.cpp
    identify_peer: the auto-id path checks no collision, routing_socket_base_t::add_out_pipe asserts; "Assertion
    failed: ok (src/socket_base.cpp:2113)"). No socket option prevents it: ROUTER_HANDOVER only governs an explicit
    id that meets an existing one (and would let a client take over another's replies: never set it),
    ROUTER_NOTIFY only reports connections, and a ZAP request does not carry the peer's ROUTING_ID.
    Residual risk: with the counter unknown, an attacker holding k explicit ids in the b"\\x00" + 4-byte space
    crashes the server with probability about k / 2**32 per later connection (k connections held open for it).
    """

    def __init__(self, on_gone: Callable[[bytes], None], heartbeat_s: float, socket: zmq.Socket | None = None) -> None:
        self.socket = socket
        self.heartbeat_s = heartbeat_s
        self.last_sent: dict[bytes, float] = {}
        self._on_gone = on_gone
        self._encoder = msgspec.msgpack.Encoder()
        self._tag_key = os.urandom(16)  # per frontend (so per process): tags cannot be matched across runs

    def tag(self, identity: bytes) -> str:
        """A short name of identity for logs: 8 hex digits of blake2b keyed with this frontend's random key, so a
        log reveals neither the identity nor the ROUTER's id counter (see the class docstring)."""
        return hashlib.blake2b(identity, key=self._tag_key, digest_size=4).hexdigest()

    def send(self, identity: bytes, msg: p.ServerMessage) -> bool:
        """Sends msg to a client; False (after on_gone) when the client is gone or too slow to read."""
        assert self.socket is not None, "the owner sets ClientFrontend.socket before the first send"
        try:
            self.socket.send_multipart([identity, self._encoder.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.info("client %s unreachable (%s); aborting its requests", self.tag(identity), exc.strerror)
            self.last_sent.pop(identity, None)
            self._on_gone(identity)
            return False
        self.last_sent[identity] = time.monotonic()
        return True

    def waiting(self, identity: bytes, now: float) -> None:
        """identity now waits for an answer: its heartbeat clock starts (if it was not running)."""
        self.last_sent.setdefault(identity, now)

    def heartbeat(self, waiting: Iterable[bytes], now: float) -> None:
        """Heartbeats each waiting client sent nothing for heartbeat_s; forgets clients no longer waiting.
        O(clients)."""
        active = set(waiting)
        for identity in active:
            if now - self.last_sent.get(identity, now) >= self.heartbeat_s:
                self.send(identity, p.Heartbeat())
        for identity in list(self.last_sent):
            if identity not in active:
                del self.last_sent[identity]
