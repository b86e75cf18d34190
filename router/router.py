"""The router: one public endpoint in front of N runtime replicas, with a replica's protocol (runtime/protocol/).

A client cannot tell it from a replica's tokenizer process: the same ROUTER socket, the same messages, the same
ErrorResponses. Per GenerateRequest the router tokenizes the prompt (the model's tokenizer and chat template, as the
replica would), hashes its full blocks with radix.hashing (cache_salt in the first block, as the replica does), picks
a replica with its Policy (router/policy.py) and forwards the request with input_ids under an internal rid, so the
replica does not tokenize twice. Replies are streamed back under the client's rid; aborts are forwarded. A
TokenizeRequest or DetokenizeRequest is answered from the router's own tokenizer (router/text.py: the replicas' rule,
with ROUTER_TOKENIZE_CHARS as its limit), so an HTTP server in front of the router needs no tokenizer either.

Failures: a replica out of rotation (router/replica.py: an unanswered probe, a health answer other than "ok", or
ERR_SHUTDOWN / ERR_SERVER for a request it had not started) has its requests that sent nothing to the client yet
re-sent to another replica (the client sees only latency); those already streaming fail with ErrorResponse(ERR_SERVER)
only when the replica is taken for dead (no answer at all): a replica that answers (wedged, suspended) ends its own
streams. A request that finds no replica in rotation waits up to pending_timeout_s, then fails with ERR_SERVER.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from radix.hashing import BlockHash, hash_block_tokens
from router.config import RouterArgs
from router.fanout import StatsFanout
from router.index import TierPrefix
from router.policy import Candidate, Policy
from router.replica import Replica
from router.stats import RouterStats
from router.text import RouterTokenizer
from runtime import protocol as p
from runtime.serve.tokenizer.frontend import ClientFrontend

logger = logging.getLogger(__name__)

POLL_MS = 100
HEARTBEAT_S = 1.0  # as the tokenizer process: a client with requests in flight and nothing sent this long is probed
_FAILURE_CODES = (p.ERR_SERVER, p.ERR_SHUTDOWN)


@dataclass
class _Request:
    """A client's request while the router holds it. started: a reply was already sent to the client."""

    identity: bytes
    rid: str
    forward: p.GenerateRequest  # what the replica gets: internal rid, input_ids when the router tokenized
    num_tokens: int
    since: float
    replica: Replica | None = None
    started: bool = False
    attempts: int = 0
    finished: set[int] = field(default_factory=set)
    hashes: dict[int, list[BlockHash]] = field(default_factory=dict)  # block size -> chained block hashes


class Router:
    """The router's state and loop. Sockets live in `ctx`; `bind()` opens the public endpoint; `serve()` runs.

    tokenizer: a transformers tokenizer (runtime.model.loader.load_tokenizer(args.model)), kept as a RouterTokenizer
    (router/text.py); None forwards requests as given (no prefix hashing: cache_aware then sees no prefix and balances
    load) and answers tokenize / detokenize requests ERR_INVALID. Mutates: its tables, its replicas.
    """

    def __init__(self, args: RouterArgs, tokenizer: Any, ctx: zmq.Context | None = None) -> None:
        self.args = args
        self.tokenizer = RouterTokenizer(tokenizer)
        self.ctx = ctx or zmq.Context()
        self.policy = Policy(args.policy, args.balance_threshold)
        self.replicas = [Replica(i, ep, self.ctx) for i, ep in enumerate(args.backends)]
        self.frontend: zmq.Socket | None = None
        self.endpoint = ""
        self.requests: dict[str, _Request] = {}  # internal rid -> request
        self.by_client: dict[tuple[bytes, str], str] = {}
        self.pending: collections.deque[str] = collections.deque()  # internal rids waiting for a replica
        self.clients = ClientFrontend(self.drop_client, HEARTBEAT_S)
        self.fanout = StatsFanout(self.clients)
        self.stats = RouterStats(routed=[0] * len(self.replicas))
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(p.ServerMessage)

    def bind(self) -> str:
        """Binds the public ROUTER on args.host:args.port (0: a free port); returns tcp://host:port."""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.bind(f"tcp://{self.args.host}:{self.args.port}")
        self.frontend = sock
        self.clients.socket = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    # ---- the loop ------------------------------------------------------------------------------------------------

    def serve(self, alive: Callable[[], bool], on_ready: Callable[[], None] | None = None) -> None:
        """Runs until alive() is False. on_ready is called once, when every backend is in rotation (or after
        args.startup_timeout_s with at least one)."""
        deadline = time.monotonic() + self.args.startup_timeout_s
        while alive():
            self.step(POLL_MS)
            if on_ready is not None:
                num_up = sum(r.up for r in self.replicas)
                if num_up == len(self.replicas) or (num_up and time.monotonic() > deadline):
                    on_ready()
                    on_ready = None

    def step(self, timeout_ms: int) -> None:
        """One poll: KV events first (so routing sees them), then replica replies, then client frames, then timers."""
        assert self.frontend is not None, "bind() before step()"
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        for r in self.replicas:
            poller.register(r.dealer, zmq.POLLIN)
            if r.sub is not None:
                poller.register(r.sub, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        now = time.monotonic()
        for r in self.replicas:
            if r.sub is not None and r.sub in ready:
                self.on_events(r, r.read_events(), now)
        for r in self.replicas:
            if r.dealer in ready:
                self._drain_replica(r, now)
        if self.frontend in ready:
            for _ in range(256):
                try:
                    frames = self.frontend.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    self.on_client_frames(frames, now)
                except Exception:  # a bug must not take the endpoint down: answer and go on
                    logger.exception("failed to handle a client message")
                    error = p.ErrorResponse("", p.ERR_SERVER, "internal error handling the request")
                    self.clients.send(frames[0], error)
        self.tick(time.monotonic())

    def on_events(self, replica: Replica, events: list, now: float) -> None:
        """Applies KV events to the replica's index; a gap starts a resync from a snapshot."""
        for event in events:
            if not replica.index.apply(event):
                self.stats.resyncs += 1
                replica.request_snapshot(now)

    def tick(self, now: float) -> None:
        """Health probes, failed replicas, pending requests, client heartbeats."""
        for r in self.replicas:
            if not r.tick(now, self.args.health_interval_s, self.args.health_timeout_s):
                self.replica_failed(r, f"no answer to a health probe for {self.args.health_timeout_s} s", now)
        self.dispatch_pending(now)
        if self.requests:
            self.heartbeat(now)

    def close(self) -> None:
        """Closes every socket (not the context)."""
        for r in self.replicas:
            r.close()
        if self.frontend is not None:
            self.frontend.close(linger=0)

    # ---- client side ---------------------------------------------------------------------------------------------

    def drop_client(self, identity: bytes) -> None:
        """Aborts every request of a vanished client (ClientFrontend's on_gone)."""
        for (ident, _rid), internal in list(self.by_client.items()):
            if ident == identity:
                self.abort(internal)

    def on_client_frames(self, frames: list[bytes], now: float) -> None:
        """Handles one message from the public ROUTER: [identity, payload]."""
        identity = frames[0]
        if len(frames) != 2:
            error = p.ErrorResponse("", p.ERR_MALFORMED, f"expected 1 frame, got {len(frames) - 1}")
            self.clients.send(identity, error)
            return
        msg = p.decode_client_frame(frames[1], self.args.max_message_bytes)
        if isinstance(msg, p.ErrorResponse):
            self.clients.send(identity, msg)
        elif isinstance(msg, p.GenerateRequest):
            self.on_generate(identity, msg, now)
        elif isinstance(msg, p.AbortRequest):
            internal = self.by_client.get((identity, msg.rid))
            if internal is not None:
                self.abort(internal)
        elif isinstance(msg, p.HealthRequest):
            if any(r.up for r in self.replicas):
                self.clients.send(identity, p.HealthResponse(msg.rid, "ok"))
            else:
                self.clients.send(identity, p.ErrorResponse(msg.rid, p.ERR_SERVER, "no replica is in rotation"))
        elif isinstance(msg, p.StatsRequest):
            self.fanout.start(identity, msg.rid, [r for r in self.replicas if r.up])
        elif isinstance(msg, (p.TokenizeRequest, p.DetokenizeRequest)):
            self.clients.send(identity, self.tokenizer.answer(msg))
        else:
            self.clients.send(
                identity,
                p.ErrorResponse(
                    msg.rid, p.ERR_INVALID, "a router holds no single KV snapshot; ask a replica's endpoint"
                ),
            )

    def on_generate(self, identity: bytes, req: p.GenerateRequest, now: float) -> None:
        """Validates, tokenizes and queues one request, then dispatches it."""
        problem = req.check()
        if problem:
            self.clients.send(identity, p.ErrorResponse(req.rid, p.ERR_INVALID, problem))
            return
        if (identity, req.rid) in self.by_client:
            self.clients.send(
                identity,
                p.ErrorResponse(req.rid, p.ERR_DUPLICATE, f"a request with rid {req.rid!r} is already in flight"),
            )
            return
        internal = uuid.uuid4().hex
        ids = self.tokenizer.prompt_ids(req)
        forward = msgspec.structs.replace(req, rid=internal)
        if ids is not None and req.input_ids is None:
            forward = msgspec.structs.replace(forward, prompt=None, messages=None, input_ids=ids)
        self.requests[internal] = _Request(identity, req.rid, forward, len(ids or ()), now)
        self.by_client[(identity, req.rid)] = internal
        self.clients.waiting(identity, now)
        self.pending.append(internal)
        self.dispatch_pending(now)

    def abort(self, internal: str) -> None:
        """Forgets a request and forwards AbortRequest to its replica (if it has one)."""
        req = self._forget(internal)
        if req is not None and req.replica is not None and req.replica.reachable:
            req.replica.send(p.AbortRequest(internal))

    def _forget(self, internal: str) -> _Request | None:
        req = self.requests.pop(internal, None)
        if req is None:
            return None
        self.by_client.pop((req.identity, req.rid), None)
        if req.replica is not None:
            req.replica.in_flight.discard(internal)
            if not req.started:
                req.replica.load_tokens -= req.num_tokens
        return req

    def heartbeat(self, now: float) -> None:
        """Heartbeats clients waiting on a request or a stats fan-out
        (runtime.serve.tokenizer.frontend.ClientFrontend)."""
        waiting = [req.identity for req in self.requests.values()] + self.fanout.identities()
        self.clients.heartbeat(waiting, now)

    # ---- routing -------------------------------------------------------------------------------------------------

    def dispatch_pending(self, now: float) -> None:
        """Sends waiting requests to replicas in rotation, in arrival order; fails those waiting too long."""
        while self.pending:
            internal = self.pending[0]
            req = self.requests.get(internal)
            if req is None or req.replica is not None:
                self.pending.popleft()
                continue
            if not self.dispatch(req, now):
                break
            self.pending.popleft()
        while self.pending:
            req = self.requests.get(self.pending[0])
            if req is not None and now - req.since <= self.args.pending_timeout_s:
                break
            self.pending.popleft()
            if req is not None:
                self._forget(req.forward.rid)
                self.clients.send(
                    req.identity,
                    p.ErrorResponse(
                        req.rid, p.ERR_SERVER, f"no replica in rotation for {self.args.pending_timeout_s} s"
                    ),
                )

    def dispatch(self, req: _Request, now: float) -> bool:
        """Chooses a replica for req and sends it; False when no replica is in rotation (req stays pending)."""
        up = [r for r in self.replicas if r.up]
        if not up:
            return False
        candidates = [Candidate(r.position, self._load(r), *self._prefix_blocks(req, r)) for r in up]
        decision = self.policy.choose(candidates, len(self.replicas))
        replica = self.replicas[decision.index]
        if not replica.send(req.forward):
            return False
        req.replica = replica
        req.attempts = req.attempts + 1
        replica.in_flight.add(req.forward.rid)
        replica.load_tokens += req.num_tokens
        self.stats.routed[replica.position] += 1
        self.stats.by_reason[decision.reason] = self.stats.by_reason.get(decision.reason, 0) + 1
        logger.debug("rid %s -> replica %d (%s; candidates %s)", req.rid, replica.position, decision.reason, candidates)
        return True

    def _load(self, replica: Replica) -> int:
        return len(replica.in_flight) if self.args.load_metric == "requests" else replica.load_tokens

    def _prefix_blocks(self, req: _Request, replica: Replica) -> TierPrefix:
        ids = req.forward.input_ids
        if ids is None or not replica.block_size or self.policy.name != "cache_aware":
            return TierPrefix(0, 0)
        hashes = req.hashes.get(replica.block_size)
        if hashes is None:
            hashes = hash_block_tokens(ids, replica.block_size, req.forward.cache_salt)
            req.hashes[replica.block_size] = hashes
        return replica.index.tier_prefix(hashes)

    # ---- replica side --------------------------------------------------------------------------------------------

    def _drain_replica(self, replica: Replica, now: float) -> None:
        dealer = replica.dealer
        for _ in range(1024):
            if replica.dealer is not dealer:
                return  # replaced (the replica failed while draining)
            try:
                frame = dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.error("replica %s: undecodable reply dropped: %s", replica.endpoint, exc)
                continue
            self.on_replica_message(replica, msg, now)

    def on_replica_message(self, replica: Replica, msg: p.ServerMessage, now: float) -> None:
        """Routes one reply of a replica: to its client, its probe, or its stats fan-out."""
        if isinstance(msg, (p.Heartbeat, p.TokenizeResponse, p.DetokenizeResponse)):
            return  # the router asks replicas for neither
        if isinstance(msg, p.HealthResponse) and msg.status != "ok" and msg.rid == replica.probe_rid and replica.up:
            replica.probe_rid = None
            self.replica_failed(replica, f"its health probe answered {msg.status!r}", now, answering=True)
            return
        if isinstance(msg, (p.HealthResponse, p.KvSnapshotResponse)):
            if replica.on_probe_answer(msg, now):
                self.dispatch_pending(now)
            return
        if isinstance(msg, p.StatsResponse):
            self.fanout.on_response(replica.position, msg.rid, msg.stats)
            return
        req = self.requests.get(msg.rid)
        if req is None or req.replica is not replica:
            return  # aborted, or re-sent elsewhere
        if isinstance(msg, p.ErrorResponse):
            if msg.code in _FAILURE_CODES and not req.started and req.attempts < 2 * len(self.replicas):
                self.replica_failed(replica, f"it failed request {req.rid}: [{msg.code}] {msg.message}", now)
                return
            self._forget(msg.rid)
            self.clients.send(req.identity, msgspec.structs.replace(msg, rid=req.rid))
            return
        if not req.started:
            req.started = True
            replica.load_tokens -= req.num_tokens
        if msg.finish_reason is not None:
            req.finished.add(msg.index)
            if len(req.finished) >= req.forward.sampling_params.n:
                self._forget(msg.rid)
        self.clients.send(req.identity, msgspec.structs.replace(msg, rid=req.rid))

    def replica_failed(self, replica: Replica, reason: str, now: float, answering: bool = False) -> None:
        """Takes a replica out of rotation: its unstarted requests go back to the front of the queue (and are
        dispatched elsewhere now), its share of stats fan-outs is dropped; its started ones fail with ERR_SERVER,
        unless answering (it answered its probe, wedged): then they are left to it and it is suspended, not marked
        down (router/replica.py)."""
        logger.warning("replica %s out of rotation: %s", replica.endpoint, reason)
        self.stats.failures += 1
        requeue = []
        for internal in sorted(replica.in_flight, key=lambda rid: self.requests[rid].since):
            req = self.requests[internal]
            if req.started and answering:
                continue
            if req.started:
                self._forget(internal)
                self.clients.send(
                    req.identity,
                    p.ErrorResponse(req.rid, p.ERR_SERVER, f"replica {replica.endpoint} failed mid-request: {reason}"),
                )
            else:
                replica.send(p.AbortRequest(internal))  # in case it is only slow
                replica.in_flight.discard(internal)  # off the replica's books (a suspended one keeps them)
                replica.load_tokens -= req.num_tokens
                req.replica = None
                requeue.append(internal)
        if answering:
            replica.suspend(reason)
        else:
            replica.mark_down(now)
        self.stats.resent += len(requeue)
        self.pending.extendleft(reversed(requeue))
        self.fanout.drop_replica(replica.position)
        self.dispatch_pending(now)
