"""The worker process loop: the ModelRunner behind two ipc sockets (docs/ARCHITECTURE.md, "Processes and sockets").

Start-up: set the OpenMP wait policy (before torch is imported: runtime/model/threads.py), load the model and
allocate the KV cache (ModelRunner), then send the runner's Ready to the scheduler and ProcessReady to the launcher;
any start-up failure (the model, the KV pool, a socket) is reported as ProcessFailed with its cause on one line.
Then: receive a ForwardBatch (PULL), execute it, send the ForwardResult (PUSH); a WorkerProbe (health) is answered
with WorkerProbeReply between steps, so only a worker whose loop runs answers it. The ModelRunner keeps each live
sequence's block table and sampling state, so each step's message carries only deltas. A step that raises is
answered with ForwardResult(error=...) and the loop goes on. The loop blocks on zmq.Poller with a
timeout (no CPU when idle) and exits when the launcher dies (PR_SET_PDEATHSIG's SIGTERM ends it even mid-step).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq

from runtime import protocol as p
from runtime.model.threads import worker_omp_env
from runtime.serve.process import POLL_MS, bind, parent_alive, report, report_failure
from runtime.serve.worker_rank import NoRelay, Relay, run_rank_loop, start_runner

logger = logging.getLogger(__name__)


class StepRunner(Protocol):
    """What the loop needs of a model runner (runtime.model.runner.ModelRunner, or a no-op runner in benchmarks)."""

    ready: p.Ready

    def execute(self, batch: p.ForwardBatch) -> p.ForwardResult: ...


def serve_worker(
    runner: StepRunner,
    pull: zmq.Socket,
    push: zmq.Socket,
    alive: Callable[[], bool],
    poll_ms: int = POLL_MS,
    relay: Relay | None = None,
) -> None:
    """Answers ForwardBatches from `pull` with ForwardResults, and WorkerProbes with WorkerProbeReplies, on `push`
    until alive() is False.

    Mutates the runner's per-sequence state (through execute). A frame that decodes as neither is logged and dropped
    (the scheduler only sends typed messages); an exception in execute becomes ForwardResult(step_id, [], [],
    error=...) so the scheduler fails that step's requests instead of hanging. relay (tensor parallelism,
    runtime/serve/worker_rank.py) gets each ForwardBatch's bytes before execute and a call after each idle poll and
    each probe (its heartbeat).
    """
    relay = relay or NoRelay()
    decoder = msgspec.msgpack.Decoder(p.WorkerInput)
    encoder = msgspec.msgpack.Encoder()
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    while alive():
        if not poller.poll(poll_ms):
            relay.idle()
            continue
        frame = pull.recv(copy=False)
        try:
            msg = decoder.decode(frame.buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.error("dropping a frame that is not a ForwardBatch or WorkerProbe: %s", exc)
            continue
        if isinstance(msg, p.WorkerProbe):
            push.send(encoder.encode(p.WorkerProbeReply(msg.probe_id)))
            relay.idle()
            continue
        relay.send(bytes(frame.buffer))
        try:
            result = runner.execute(msg)
        except Exception as exc:  # the step fails, the worker keeps serving
            logger.exception("step %d failed", msg.step_id)
            result = p.ForwardResult(msg.step_id, [], [], error=f"{type(exc).__name__}: {exc}")
        push.send(encoder.encode(result), copy=False)


def run_worker_process(spec) -> None:
    """Worker process entry (spec: runtime.serve.process.ChildSpec), rank 0 under tensor parallelism
    (runtime/serve/worker_rank.py). Returns when the launcher dies, or after reporting ProcessFailed when the model
    runner or a socket cannot start."""
    ctx = zmq.Context()
    reports = ctx.socket(zmq.PUSH)
    reports.connect(spec.endpoints.launcher)
    os.environ.update(worker_omp_env(os.environ))  # before torch loads libgomp, which reads it once (threads.py)
    try:
        runner, relay, group = start_runner(spec.server_args, 0)
        pull = ctx.socket(zmq.PULL)
        bind(pull, spec.endpoints.worker_in, "worker_in")
        push = ctx.socket(zmq.PUSH)
        push.connect(spec.endpoints.worker_out)
    except Exception as exc:
        report_failure(ctx, reports, "worker", exc)
        return
    push.send(msgspec.msgpack.encode(runner.ready))
    report(reports, p.ProcessReady("worker", os.getpid()))
    logger.info("worker ready: %s", runner.ready)
    if group is None:
        serve_worker(runner, pull, push, lambda: parent_alive(spec))
        return
    run_rank_loop(lambda: serve_worker(runner, pull, push, lambda: parent_alive(spec), relay=relay))
