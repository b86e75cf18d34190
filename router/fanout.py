"""StatsFanout: a client's StatsRequest asked of every replica in rotation, answered with their merged ServerStats."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from router.replica import Replica
from router.stats import merge_stats
from runtime import protocol as p
from runtime.serve.tokenizer.frontend import ClientFrontend


@dataclass
class _Fanout:
    """A client's StatsRequest, asked of every replica in rotation."""

    identity: bytes
    rid: str
    waiting: set[int]
    stats: list[p.ServerStats] = field(default_factory=list)


class StatsFanout:
    """The stats requests in flight, by the internal rid the replicas were asked under. Mutates: its table; sends
    StatsRequests to replicas and the answer (or ErrorResponse) to the client through `clients`."""

    def __init__(self, clients: ClientFrontend) -> None:
        self.clients = clients
        self.fanouts: dict[str, _Fanout] = {}

    def identities(self) -> list[bytes]:
        """The clients waiting on a fan-out (they are heartbeated like clients waiting on a request)."""
        return [f.identity for f in self.fanouts.values()]

    def start(self, identity: bytes, rid: str, up: list[Replica]) -> None:
        """Asks every replica of `up` (those in rotation) for its ServerStats; the sum is answered when all have
        replied. No replica in rotation: ErrorResponse(ERR_SERVER) at once."""
        if not up:
            self.clients.send(identity, p.ErrorResponse(rid, p.ERR_SERVER, "no replica is in rotation"))
            return
        internal = uuid.uuid4().hex
        self.fanouts[internal] = _Fanout(identity, rid, {r.position for r in up})
        self.clients.waiting(identity, time.monotonic())
        for r in up:
            r.send(p.StatsRequest(internal))

    def on_response(self, position: int, internal: str, stats: p.ServerStats | None) -> None:
        """Folds one replica's stats (None: it left rotation) into its fan-out; replies once all are in."""
        fan = self.fanouts.get(internal)
        if fan is None or position not in fan.waiting:
            return
        fan.waiting.discard(position)
        if stats is not None:
            fan.stats.append(stats)
        if not fan.waiting:
            del self.fanouts[internal]
            if fan.stats:
                self.clients.send(fan.identity, p.StatsResponse(fan.rid, merge_stats(fan.stats)))
            else:
                self.clients.send(fan.identity, p.ErrorResponse(fan.rid, p.ERR_SERVER, "no replica answered"))

    def drop_replica(self, position: int) -> None:
        """A replica left rotation: every fan-out stops waiting for it."""
        for internal in list(self.fanouts):
            self.on_response(position, internal, None)
