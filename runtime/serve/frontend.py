"""ClientFrontend: the client side of a public ROUTER endpoint, shared by the tokenizer process and the router.

It sends replies to client identities without blocking, notices a vanished client (a send that fails under
ROUTER_MANDATORY or a full queue) and heartbeats every client that is waiting, so a client that hears nothing for its
liveness interval knows the server is gone (runtime.client.ServerGoneError).
"""

from __future__ import annotations

import logging
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
    """

    def __init__(self, on_gone: Callable[[bytes], None], heartbeat_s: float,
                 socket: zmq.Socket | None = None) -> None:
        self.socket, self.heartbeat_s = socket, heartbeat_s
        self.last_sent: dict[bytes, float] = {}
        self._on_gone = on_gone
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, identity: bytes, msg: p.ServerMessage) -> bool:
        """Sends msg to a client; False (after on_gone) when the client is gone or too slow to read."""
        assert self.socket is not None, "the owner sets ClientFrontend.socket before the first send"
        try:
            self.socket.send_multipart([identity, self._encoder.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.info("client %s unreachable (%s); aborting its requests", identity.hex(), exc.strerror)
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
