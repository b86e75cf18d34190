"""Replica: the router's link to one runtime replica: a DEALER to its public endpoint (requests, health probes, KV
snapshots), a SUB to its KV events (TCP), its ReplicaIndex, and whether it is in rotation.

Life cycle: a replica starts out of rotation. Every health_interval_s the router asks it for a KvSnapshotResponse;
the first answer names its events port, so the SUB connects and a second snapshot is asked (now that the SUB
listens, no event between the snapshot and the stream is lost; a lost one shows as a seq gap). Loading that snapshot
puts the replica in rotation. In rotation it is probed with HealthRequest. A replica that answers is never taken for
dead: a busy one answers "ok" at once (runtime/serve/health.py); one that answers anything else (its worker made no
step progress: wedged) is `suspend`ed: out of rotation for new requests, still connected, its streams left to it, and
back in rotation at its next "ok". A probe unanswered for health_timeout_s (dead, or the whole replica frozen) takes
it out (`mark_down`): its DEALER is replaced, so requests queued for a dead peer are never delivered to a replica
that comes back on the same endpoint, and its index is cleared until a fresh snapshot.
"""

from __future__ import annotations

import logging
import uuid
from urllib.parse import urlsplit

import msgspec
import zmq

from radix.events import KvEvent
from router.index import ReplicaIndex
from runtime import protocol as p

logger = logging.getLogger(__name__)

TOPIC_KV = b"kv"  # runtime/scheduler_process.py publishes KV events under this topic
_encoder = msgspec.msgpack.Encoder()
_event_decoder = msgspec.msgpack.Decoder(KvEvent)


class Replica:
    """One backend. `up`: in rotation. `suspended`: why it is out of rotation while it still answers (None: it is
    not). `in_flight`: internal rids of requests it serves. `load_tokens`: prompt
    tokens of its requests that produced no output yet. Mutates its own sockets and index only.

    endpoint: "tcp://HOST:PORT" of the replica's public endpoint; the KV events are read from tcp://HOST:<events
    port the replica reports>.
    """

    def __init__(self, position: int, endpoint: str, ctx: zmq.Context) -> None:
        self.position = position
        self.endpoint = endpoint
        self.ctx = ctx
        self.host = urlsplit(endpoint).hostname or "127.0.0.1"
        self.dealer = self._new_dealer()
        self.sub: zmq.Socket | None = None
        self.events_port = 0
        self.block_size = 0
        self.index = ReplicaIndex()
        self.up = False
        self.suspended: str | None = None
        self.in_flight: set[str] = set()
        self.load_tokens = 0
        self.probe_rid: str | None = None  # the health probe or snapshot request awaiting its answer
        self.probe_sent = 0.0
        self.next_probe = 0.0
        self.num_resyncs = 0

    def _new_dealer(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.connect(self.endpoint)
        return sock

    def send(self, msg: p.ClientMessage) -> bool:
        """Sends one message to the replica without blocking; False when it cannot take it (queue full)."""
        try:
            self.dealer.send(_encoder.encode(msg), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("replica %s: send failed (%s)", self.endpoint, exc.strerror)
            return False
        return True

    @property
    def reachable(self) -> bool:
        """In rotation, or suspended (it answers): requests it holds are its own to end."""
        return self.up or self.suspended is not None

    def tick(self, now: float, interval_s: float, timeout_s: float) -> bool:
        """Sends the next probe when due. Returns False when the replica is reachable and its probe has been
        unanswered for timeout_s seconds (the caller takes it out of rotation)."""
        if self.probe_rid is not None:
            if now - self.probe_sent <= timeout_s:
                return True
            if self.reachable:
                return False
        elif now < self.next_probe:
            return True
        healthy = (self.up and not self.index.syncing) or self.suspended is not None
        msg_type = p.HealthRequest if healthy else p.KvSnapshotRequest
        self._probe(msg_type, now)
        self.next_probe = now + interval_s
        return True

    def _probe(self, msg_type: type, now: float) -> None:
        self.probe_rid = f"probe-{uuid.uuid4().hex}"
        self.probe_sent = now
        self.send(msg_type(self.probe_rid))

    def request_snapshot(self, now: float) -> None:
        """After a gap: buffer events and ask for a snapshot (unless a probe is already out; the next is one)."""
        self.index.begin_sync()
        self.num_resyncs += 1
        if self.probe_rid is None:
            self._probe(p.KvSnapshotRequest, now)

    def on_probe_answer(self, msg: p.HealthResponse | p.KvSnapshotResponse, now: float) -> bool:
        """Applies the answer to a probe. Returns True when this answer put the replica (back) in rotation."""
        if msg.rid != self.probe_rid:
            return False  # the answer to an older probe, overtaken
        self.probe_rid = None
        if isinstance(msg, p.HealthResponse):
            if msg.status != "ok" or self.suspended is None:
                return False
            logger.info("replica %s back in rotation (its health probe answers ok)", self.endpoint)
            self.suspended = None
            self.up = True
            return True
        self.block_size = msg.block_size
        if msg.events_port and msg.events_port != self.events_port:
            self._connect_events(msg.events_port)
            self._probe(p.KvSnapshotRequest, now)  # this snapshot may predate the subscription: ask again
            return False
        if not msg.events_port:
            logger.warning(
                "replica %s publishes no KV events on TCP (start it with --events-port); its cache is "
                "invisible to the router",
                self.endpoint,
            )
        if not self.index.load_snapshot(msg.snapshot):
            self._probe(p.KvSnapshotRequest, now)
        was_up = self.up
        self.up = True
        if not was_up:
            logger.info(
                "replica %s in rotation (%d resident blocks, event seq %d)",
                self.endpoint,
                len(self.index.hashes),
                self.index.last_seq,
            )
        return not was_up

    def _connect_events(self, port: int) -> None:
        if self.sub is not None:
            self.sub.close(linger=0)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC_KV)
        self.sub.connect(f"tcp://{self.host}:{port}")
        self.events_port = port
        self.index.clear()

    def read_events(self, max_events: int = 4096) -> list[KvEvent]:
        """KV events waiting on the SUB (without blocking). A frame that does not decode is logged and dropped (the
        next event then shows a gap)."""
        events: list[KvEvent] = []
        if self.sub is None:
            return events
        for _ in range(max_events):
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                events.append(_event_decoder.decode(frames[-1]))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.error("replica %s: undecodable KV event dropped: %s", self.endpoint, exc)
        return events

    def suspend(self, reason: str) -> None:
        """Out of rotation while it still answers (reason: its health answer): its connection, index and the
        requests it holds are kept; an "ok" health answer puts it back (on_probe_answer)."""
        self.up = False
        self.suspended = reason

    def mark_down(self, now: float) -> None:
        """Out of rotation: forget its index and in-flight set, replace the DEALER (dropping queued messages)."""
        self.up = False
        self.suspended = None
        self.index.clear()
        self.in_flight.clear()
        self.load_tokens = 0
        self.probe_rid = None
        self.next_probe = now
        self.dealer.close(linger=200)  # the aborts just sent may still reach a replica that is only slow
        self.dealer = self._new_dealer()

    def close(self) -> None:
        """Closes both sockets."""
        self.dealer.close(linger=0)
        if self.sub is not None:
            self.sub.close(linger=0)
