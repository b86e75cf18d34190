"""The worker process loop: the ModelRunner behind two ipc sockets (ARCHITECTURE.md, "Processes and sockets").

Start-up: load the model and allocate the KV cache (ModelRunner), then send the runner's Ready to the scheduler and
ProcessReady to the launcher; a failure to load is reported as ProcessFailed. Then: receive a ForwardBatch (PULL),
execute it, send the ForwardResult (PUSH). The ModelRunner keeps each live sequence's block table and sampling state,
so each step's message carries only deltas. A step that raises is answered with ForwardResult(error=...) and the loop
goes on. The loop blocks on zmq.Poller with a timeout (no CPU when idle) and exits when the launcher dies.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq

from runtime import protocol as p
from runtime.serve.process import POLL_MS

logger = logging.getLogger(__name__)



class StepRunner(Protocol):
    """What the loop needs of a model runner (runtime.model.runner.ModelRunner, or a no-op runner in benchmarks)."""

    ready: p.Ready

    def execute(self, batch: p.ForwardBatch) -> p.ForwardResult: ...


def serve_worker(runner: StepRunner, pull: zmq.Socket, push: zmq.Socket, alive: Callable[[], bool],
                 poll_ms: int = POLL_MS) -> None:
    """Answers ForwardBatches from `pull` with ForwardResults on `push` until alive() is False.

    Mutates the runner's per-sequence state (through execute). A frame that does not decode as a ForwardBatch is
    logged and dropped (the scheduler only sends typed batches); an exception in execute becomes
    ForwardResult(step_id, [], [], error=...) so the scheduler fails that step's requests instead of hanging.
    """
    decoder = msgspec.msgpack.Decoder(p.ForwardBatch)
    encoder = msgspec.msgpack.Encoder()
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    while alive():
        if not poller.poll(poll_ms):
            continue
        frame = pull.recv(copy=False)
        try:
            batch = decoder.decode(frame.buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.error("dropping a frame that is not a ForwardBatch: %s", exc)
            continue
        try:
            result = runner.execute(batch)
        except Exception as exc:  # the step fails, the worker keeps serving
            logger.exception("step %d failed", batch.step_id)
            result = p.ForwardResult(batch.step_id, [], [], error=f"{type(exc).__name__}: {exc}")
        push.send(encoder.encode(result), copy=False)


def run_worker_process(spec) -> None:
    """Worker process entry (spec: runtime.serve.process.ChildSpec). Returns when the launcher dies."""
    from runtime.serve.process import parent_alive, report

    ctx = zmq.Context()
    reports = ctx.socket(zmq.PUSH)
    reports.connect(spec.endpoints.launcher)
    try:
        from runtime.model.runner import ModelRunner

        runner = ModelRunner(spec.server_args)
    except Exception as exc:
        logger.exception("model runner failed to start")
        report(reports, p.ProcessFailed("worker", os.getpid(), f"{type(exc).__name__}: {exc}"))
        reports.close(linger=2000)
        return
    pull = ctx.socket(zmq.PULL)
    pull.bind(spec.endpoints.worker_in)
    push = ctx.socket(zmq.PUSH)
    push.connect(spec.endpoints.worker_out)
    push.send(msgspec.msgpack.encode(runner.ready))
    report(reports, p.ProcessReady("worker", os.getpid()))
    logger.info("worker ready: %s", runner.ready)
    serve_worker(runner, pull, push, lambda: parent_alive(spec))
