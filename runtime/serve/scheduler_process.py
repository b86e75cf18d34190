"""The scheduler process loop: the Scheduler between the tokenizer and the worker (ARCHITECTURE.md).

Start-up: wait for the worker's Ready, size the KVCacheManager from it, tell the tokenizer (SchedulerReady) and the
launcher (ProcessReady). Then one step at a time: when no batch is in flight, `schedule()` and send the ForwardBatch;
while the worker runs it, handle the tokenizer's messages (new requests, aborts, stops, health, stats); on the
ForwardResult, `process_result()` and send the step's TokenOutputs to the tokenizer in one message. KV events and
ServerStats are published on a PUB socket (topics b"kv" and b"stats"). The loop blocks on zmq.Poller with a timeout
(an idle server sleeps) and exits when the launcher dies.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from runtime import protocol as p
from runtime.serve.process import POLL_MS

if TYPE_CHECKING:
    from runtime.scheduler import Scheduler

logger = logging.getLogger(__name__)

TOPIC_KV, TOPIC_STATS = b"kv", b"stats"


class SchedulerServer:
    """Drives a runtime.scheduler.Scheduler from socket messages. Sockets are passed in so tests can drive it.

    to_worker: PUSH ForwardBatch. to_tokenizer: PUSH TokenOutputs / replies. pub: PUB for KV events and stats
    (None: not published). Mutates the scheduler; at most one batch is in flight.
    """

    def __init__(self, scheduler: Scheduler, to_worker: zmq.Socket, to_tokenizer: zmq.Socket, pub: zmq.Socket | None,
                 stats_interval_s: float, events_port: int = 0) -> None:
        self.scheduler, self.to_worker, self.to_tokenizer, self.pub = scheduler, to_worker, to_tokenizer, pub
        self.stats_interval_s = stats_interval_s
        self.events_port = events_port  # TCP port of pub for routers (0: ipc only)
        self.in_flight = False
        self._encoder = msgspec.msgpack.Encoder()
        self._last_stats = (time.monotonic(), 0)  # (time, forward tokens) at the last published stats
        self._tokens_per_s = 0.0

    def on_tokenizer_message(self, msg: p.SchedulerInput) -> None:
        """Applies one tokenizer message; a request the scheduler rejects is answered with RequestFailed."""
        from runtime.request import RequestRejected, UnknownRequestError

        sched = self.scheduler
        if isinstance(msg, p.TokenizedRequest):
            try:
                sched.add_request(msg.rid, msg.input_ids, msg.sampling_params, msg.cache_salt)
            except RequestRejected as exc:
                self._send(p.RequestFailed(msg.rid, exc.code, str(exc)))
            except ValueError as exc:
                self._send(p.RequestFailed(msg.rid, p.ERR_DUPLICATE, str(exc)))
        elif isinstance(msg, p.AbortRequest):
            try:
                sched.abort(msg.rid)
            except UnknownRequestError:
                pass  # already finished
        elif isinstance(msg, p.Stop):
            try:
                sched.stop(msg.rid, msg.keep_tokens, msg.index)
            except UnknownRequestError:
                pass
        elif isinstance(msg, p.HealthRequest):
            self._send(p.HealthResponse(msg.rid, "ok"))
        elif isinstance(msg, p.StatsRequest):
            self._send(p.StatsResponse(msg.rid, self.server_stats()))
        elif isinstance(msg, p.KvSnapshotRequest):
            manager = sched.manager
            self._send(p.KvSnapshotResponse(msg.rid, manager.block_size, self.events_port, manager.kv_snapshot()))

    def try_schedule(self) -> None:
        """Sends the next ForwardBatch when none is in flight and the scheduler has one."""
        if self.in_flight:
            return
        batch = self.scheduler.schedule()
        if batch is not None:
            self.to_worker.send(self._encoder.encode(batch), copy=False)
            self.in_flight = True
        self.flush_outputs(self.scheduler.drain_outputs())

    def on_result(self, result: p.ForwardResult) -> None:
        """Applies the worker's result and forwards the step's TokenOutputs and KV events. When the worker failed
        the step, the requests the scheduler ended for it get RequestFailed (clients see ERR_SERVER, not a quiet
        "abort")."""
        self.in_flight = False
        outputs = self.scheduler.process_result(result)
        if result.error is not None:
            failed = {o.rid for o in outputs if o.finish_reason == "abort"}
            outputs = [o for o in outputs if o.rid not in failed]
            for rid in sorted(failed):
                self._send(p.RequestFailed(rid, p.ERR_SERVER, f"the worker failed step {result.step_id}: "
                                                              f"{result.error}"))
        self.flush_outputs(outputs)

    def flush_outputs(self, outputs: list[p.TokenOutput]) -> None:
        if outputs:
            self._send(p.TokenOutputs(outputs))
        if self.pub is not None:
            for event in self.scheduler.manager.drain_events():
                self.pub.send_multipart([TOPIC_KV, self._encoder.encode(event)])

    def _send(self, msg: p.TokenizerInput) -> None:
        self.to_tokenizer.send(self._encoder.encode(msg))

    def server_stats(self) -> p.ServerStats:
        """Scheduler.stats() with tokens_per_s filled in from the last stats interval (see publish_stats)."""
        stats = self.scheduler.stats()
        stats.tokens_per_s = self._tokens_per_s
        return stats

    def publish_stats(self, now: float) -> None:
        """Publishes ServerStats every stats_interval_s (tokens_per_s: forward tokens over the interval)."""
        then, tokens_then = self._last_stats
        if now - then < self.stats_interval_s:
            return
        tokens = self.scheduler.counters.forward_tokens
        self._tokens_per_s = (tokens - tokens_then) / (now - then)
        self._last_stats = (now, tokens)
        if self.pub is not None:
            self.pub.send_multipart([TOPIC_STATS, self._encoder.encode(self.server_stats())])


def serve_scheduler(server: SchedulerServer, from_tokenizer: zmq.Socket, from_worker: zmq.Socket, alive) -> None:
    """The loop until alive() is False. A frame that does not decode is logged and dropped (only our own processes
    write to these ipc sockets)."""
    tok_decoder = msgspec.msgpack.Decoder(p.SchedulerInput)
    worker_decoder = msgspec.msgpack.Decoder(p.ForwardResult)
    poller = zmq.Poller()
    poller.register(from_tokenizer, zmq.POLLIN)
    poller.register(from_worker, zmq.POLLIN)
    while alive():
        server.try_schedule()
        events = dict(poller.poll(POLL_MS))
        if from_worker in events:
            _handle(from_worker, worker_decoder, server.on_result)
        if from_tokenizer in events:
            for _ in range(256):
                if not _handle(from_tokenizer, tok_decoder, server.on_tokenizer_message):
                    break
        server.publish_stats(time.monotonic())


def _handle(sock: zmq.Socket, decoder: msgspec.msgpack.Decoder, handler) -> bool:
    """Receives one frame without blocking and hands it to handler; False when none was waiting."""
    try:
        frame = sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return False
    try:
        msg = decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        logger.error("dropping an undecodable internal frame: %s", exc)
        return True
    handler(msg)
    return True


def run_scheduler_process(spec) -> None:
    """Scheduler process entry (spec: runtime.serve.process.ChildSpec). Returns when the launcher dies."""
    from radix.manager import KVCacheManager
    from runtime.scheduler import Scheduler
    from runtime.serve.process import parent_alive, report

    args, ep = spec.server_args, spec.endpoints
    ctx = zmq.Context()
    reports = ctx.socket(zmq.PUSH)
    reports.connect(ep.launcher)
    from_worker, from_tokenizer = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    from_worker.bind(ep.worker_out)
    from_tokenizer.bind(ep.scheduler_in)
    to_worker, to_tokenizer, pub = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH), ctx.socket(zmq.PUB)
    to_worker.connect(ep.worker_in)
    to_tokenizer.connect(ep.tokenizer_in)
    pub.bind(ep.events)
    events_port = 0
    if args.events_port is not None:
        pub.bind(f"tcp://{args.host}:{args.events_port}")
        events_port = int(pub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    ready_decoder = msgspec.msgpack.Decoder(p.Ready)
    ready = None
    while ready is None and parent_alive(spec):
        if from_worker.poll(POLL_MS):
            ready = ready_decoder.decode(from_worker.recv())
    if ready is None:
        return
    manager = KVCacheManager(ready.num_blocks, ready.block_size, args.enable_prefix_caching, ready.num_host_blocks)
    scheduler = Scheduler(manager, args, ready.max_model_len, ready.eos_token_ids, vocab_size=ready.vocab_size)
    server = SchedulerServer(scheduler, to_worker, to_tokenizer, pub, args.log_interval_s, events_port)
    to_tokenizer.send(msgspec.msgpack.encode(p.SchedulerReady(ready)))
    report(reports, p.ProcessReady("scheduler", os.getpid()))
    logger.info("scheduler ready: %d KV blocks of %d tokens", ready.num_blocks, ready.block_size)
    serve_scheduler(server, from_tokenizer, from_worker, lambda: parent_alive(spec))
