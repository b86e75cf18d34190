"""The scheduler process loop: the Scheduler between the tokenizer and the worker (docs/ARCHITECTURE.md).

Start-up: wait for the worker's Ready, size the KVCacheManager from it, tell the tokenizer (SchedulerReady) and the
launcher (ProcessReady); a start-up failure (a socket that cannot bind, such as a busy --events-port, or a KV pool the
scheduler cannot size) is reported as ProcessFailed with its cause on one line. Then one step at a time: when no batch
is in flight, `schedule()` and send the ForwardBatch; while the worker runs it, handle the tokenizer's messages (new
requests, aborts, stops, health, stats); on the ForwardResult, `process_result()` and send the step's TokenOutputs to
the tokenizer in one message. A health request is answered at once while a step is in flight ("ok" while the step is
younger than worker_probe_timeout_s, "worker unresponsive for N s" after), and probes an idle worker
(runtime.serve.health.WorkerHealth): "ok" once the worker's loop answered, "worker unresponsive for N s" after
worker_probe_timeout_s without an answer. KV events and
ServerStats are published on a PUB socket (topics b"kv" and b"stats"); with --kv-events-config the KV events also go
out in vLLM's wire format (runtime/serve/vllm_events), from the same drain. The loop blocks on zmq.Poller with a timeout
(an idle server sleeps) and exits when the launcher dies.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import zmq

from runtime import protocol as p
from runtime.serve.health import WorkerHealth
from runtime.serve.process import POLL_MS, bind, parent_alive, report, report_failure
from runtime.serve.vllm_events.publisher import NullEventPublisher, VllmEventPublisher, make_publisher

if TYPE_CHECKING:
    from runtime.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

TOPIC_KV, TOPIC_STATS = b"kv", b"stats"


class SchedulerServer:
    """Drives a runtime.scheduler.scheduler.Scheduler from socket messages. Sockets are passed in so tests can drive it.

    to_worker: PUSH ForwardBatch / WorkerProbe. to_tokenizer: PUSH TokenOutputs / replies. pub: PUB for KV events and
    stats (None: not published). worker_probe_timeout_s: seconds a health request waits for the worker's answer.
    vllm_events: publishes the same KV events in vLLM's format (a NullEventPublisher: not at all).
    Mutates the scheduler; at most one batch is in flight.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        to_worker: zmq.Socket,
        to_tokenizer: zmq.Socket,
        pub: zmq.Socket | None,
        stats_interval_s: float,
        events_port: int = 0,
        worker_probe_timeout_s: float = 5.0,
        vllm_events: NullEventPublisher | VllmEventPublisher | None = None,
    ) -> None:

        self.scheduler = scheduler
        self.to_worker = to_worker
        self.to_tokenizer = to_tokenizer
        self.pub = pub
        self.stats_interval_s = stats_interval_s
        self.events_port = events_port  # TCP port of pub for routers (0: ipc only)
        self.health = WorkerHealth(worker_probe_timeout_s)
        self.vllm_events = vllm_events if vllm_events is not None else NullEventPublisher()
        self.in_flight = False
        self.step_sent: float | None = None  # monotonic time the step in flight was sent (None: none in flight)
        self.step_tokens = 0  # input tokens of the step in flight
        self._encoder = msgspec.msgpack.Encoder()
        self._last_stats = (time.monotonic(), 0)  # (time, forward tokens) at the last published stats
        self._tokens_per_s = 0.0

    def on_tokenizer_message(self, msg: p.SchedulerInput) -> None:
        """Applies one tokenizer message; a request the scheduler rejects is answered with RequestFailed."""
        from runtime.scheduler.request import RequestRejected, UnknownRequestError

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
            now = time.monotonic()
            status = self.health.step_status(self.step_sent, self.step_tokens, now)  # at once: no wait for the step
            if status is not None:
                self._send(p.HealthResponse(msg.rid, status))
                return
            probe = self.health.on_request(msg.rid, now)
            if probe is not None:
                self.to_worker.send(self._encoder.encode(probe))
        elif isinstance(msg, p.StatsRequest):
            self._send(p.StatsResponse(msg.rid, self.server_stats()))
        elif isinstance(msg, p.KvSnapshotRequest):
            manager = sched.manager
            self._send(p.KvSnapshotResponse(msg.rid, manager.block_size, self.events_port, manager.kv_snapshot()))

    def on_worker_message(self, msg: p.WorkerOutput) -> None:
        """A ForwardResult goes to on_result; a WorkerProbeReply answers the health requests waiting ("ok")."""
        if isinstance(msg, p.ForwardResult):
            self.on_result(msg)
        else:
            for answer in self.health.on_reply(msg):
                self._send(answer)

    def expire_health(self, now: float) -> None:
        """Answers the health requests that waited worker_probe_timeout_s for the worker: "worker unresponsive"."""
        for answer in self.health.expire(now):
            self._send(answer)

    def try_schedule(self) -> None:
        """Sends the next ForwardBatch when none is in flight and the scheduler has one."""
        if self.in_flight:
            return
        batch = self.scheduler.schedule()
        if batch is not None:
            self.to_worker.send(self._encoder.encode(batch), copy=False)
            self.in_flight = True
            self.step_sent = time.monotonic()
            self.step_tokens = sum(len(s.token_ids) for s in batch.seqs)
        self.flush_outputs(self.scheduler.drain_outputs())

    def on_result(self, result: p.ForwardResult) -> None:
        """Applies the worker's result and forwards the step's TokenOutputs and KV events. Each request the
        scheduler failed for it (a sequence the worker could not run, or every request of a step that failed as a
        whole) gets RequestFailed(rid, ERR_SERVER, why) (ERR_INVALID when its own constraint allowed no token)
        instead of its TokenOutputs (clients see an error, not a quiet "abort"); every other request's outputs go on
        unchanged."""
        self.in_flight = False
        if self.step_sent is not None:
            self.health.on_step(time.monotonic() - self.step_sent, self.step_tokens)
        self.step_sent = None
        outputs = self.scheduler.process_result(result)
        failures = self.scheduler.drain_failures()
        if failures:
            failed = {f.rid for f in failures}
            outputs = [o for o in outputs if o.rid not in failed]
            for f in failures:
                self._send(p.RequestFailed(f.rid, f.code, f.message))
        self.flush_outputs(outputs)

    def flush_outputs(self, outputs: list[p.TokenOutput]) -> None:
        if outputs:
            self._send(p.TokenOutputs(outputs))
        if self.pub is not None:
            events = self.scheduler.manager.drain_events()
            for event in events:
                self.pub.send_multipart([TOPIC_KV, self._encoder.encode(event)])
            self.vllm_events.publish(events)

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
    worker_decoder = msgspec.msgpack.Decoder(p.WorkerOutput)
    poller = zmq.Poller()
    poller.register(from_tokenizer, zmq.POLLIN)
    poller.register(from_worker, zmq.POLLIN)
    replay = server.vllm_events.replay
    if replay is not None:
        poller.register(replay, zmq.POLLIN)
    while alive():
        server.try_schedule()
        events = dict(poller.poll(POLL_MS))
        if from_worker in events:
            _handle(from_worker, worker_decoder, server.on_worker_message)
        if from_tokenizer in events:
            for _ in range(256):
                if not _handle(from_tokenizer, tok_decoder, server.on_tokenizer_message):
                    break
        if replay is not None and replay in events:
            server.vllm_events.serve_replay()
        now = time.monotonic()
        server.publish_stats(now)
        server.expire_health(now)


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


@dataclass
class _Links:
    """The scheduler process's sockets, bound and connected (runtime.serve.process.Endpoints)."""

    from_worker: zmq.Socket
    from_tokenizer: zmq.Socket
    to_worker: zmq.Socket
    to_tokenizer: zmq.Socket
    pub: zmq.Socket
    events_port: int  # the TCP port pub is bound on beside its ipc endpoint (0: ipc only)
    vllm_events: NullEventPublisher | VllmEventPublisher  # --kv-events-config


def _open_links(ctx: zmq.Context, spec) -> _Links:
    """Binds and connects every socket. Raises StartupError naming the endpoint that cannot be bound (e.g. "cannot
    bind events_port tcp://127.0.0.1:5599: Address already in use")."""
    args, ep = spec.server_args, spec.endpoints
    from_worker, from_tokenizer = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    bind(from_worker, ep.worker_out, "worker_out")
    bind(from_tokenizer, ep.scheduler_in, "scheduler_in")
    to_worker, to_tokenizer, pub = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH), ctx.socket(zmq.PUB)
    to_worker.connect(ep.worker_in)
    to_tokenizer.connect(ep.tokenizer_in)
    bind(pub, ep.events, "events")
    events_port = 0
    if args.events_port is not None:
        bind(pub, f"tcp://{args.host}:{args.events_port}", "events_port")
        events_port = int(pub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    vllm_events = make_publisher(ctx, args.kv_events_config, args.host, args.data_parallel_rank)
    return _Links(from_worker, from_tokenizer, to_worker, to_tokenizer, pub, events_port, vllm_events)


def _wait_worker_ready(links: _Links, spec) -> p.Ready | None:
    """The worker's Ready, or None when the launcher died first."""
    decoder = msgspec.msgpack.Decoder(p.Ready)
    while parent_alive(spec):
        if links.from_worker.poll(POLL_MS):
            return decoder.decode(links.from_worker.recv())
    return None


def _make_server(spec, ready: p.Ready, links: _Links) -> SchedulerServer:
    """The Scheduler over a KVCacheManager sized from the worker's Ready, behind a SchedulerServer. Raises what they
    raise for sizes they cannot serve (ValueError, InvalidConfig)."""
    from runtime.scheduler.kv_groups import make_manager
    from runtime.scheduler.scheduler import Scheduler

    args = spec.server_args
    manager = make_manager(
        ready,
        args,
        record_events=True,  # the PUB socket publishes (and so drains) them
        event_token_ids=links.vllm_events.records_token_ids,  # vLLM's BlockStored carries them
    )
    scheduler = Scheduler(manager, args, ready.max_model_len, ready.eos_token_ids, vocab_size=ready.vocab_size)
    return SchedulerServer(
        scheduler,
        links.to_worker,
        links.to_tokenizer,
        links.pub,
        args.log_interval_s,
        links.events_port,
        args.worker_probe_timeout_s,
        links.vllm_events,
    )


def run_scheduler_process(spec) -> None:
    """Scheduler process entry (spec: runtime.serve.process.ChildSpec). Returns when the launcher dies, or after
    reporting ProcessFailed when a socket cannot be bound or the scheduler cannot be built from the worker's Ready."""
    ctx = zmq.Context()
    reports = ctx.socket(zmq.PUSH)
    reports.connect(spec.endpoints.launcher)
    try:
        links = _open_links(ctx, spec)
        ready = _wait_worker_ready(links, spec)
        if ready is None:
            return
        server = _make_server(spec, ready, links)
    except Exception as exc:
        report_failure(ctx, reports, "scheduler", exc)
        return
    links.to_tokenizer.send(msgspec.msgpack.encode(p.SchedulerReady(ready)))
    report(reports, p.ProcessReady("scheduler", os.getpid(), max_model_len=ready.max_model_len))
    logger.info("scheduler ready: %d KV blocks of %d tokens", ready.num_blocks, ready.block_size)
    serve_scheduler(server, links.from_tokenizer, links.from_worker, lambda: parent_alive(spec))
