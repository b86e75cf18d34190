"""The tokenizer process entry (role "tokenizer"): loads the model's tokenizer, waits for the scheduler to be ready,
binds the public endpoint, reports ProcessReady(endpoint) to the launcher and runs the loop
(runtime.serve.tokenizer.loop) over a TokenizerServer (runtime.serve.tokenizer.server) until Shutdown or the launcher
dies; then every request still in flight is answered.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import msgspec
import zmq

from runtime import protocol as p
from runtime.serve.process import POLL_MS, ChildSpec, keep_running, one_line, report, stop_message, zmq_reason
from runtime.serve.tokenizer.loop import serve_tokenizer
from runtime.serve.tokenizer.server import TokenizerServer

logger = logging.getLogger(__name__)

ROUTER_SNDHWM = 100_000  # frames queued per client before a send counts it gone (ClientFrontend)
LINGER_MS = 1000  # how long the last answers may take to leave at exit


def run_tokenizer_process(spec: ChildSpec) -> None:
    """Tokenizer process entry. Binds the public endpoint tcp://host:port of spec.server_args once the scheduler is
    ready, reports ProcessReady(endpoint) to the launcher, serves until Shutdown or the launcher dies. A failure to
    load the tokenizer or to bind is reported as ProcessFailed (one line), then it returns.

    A model folder's tokenizer loads while the worker loads the weights; an embedded name or a GGUF file's loads
    after the worker is ready, so a first run converts the GGUF file once, not in two processes at the same time."""
    args = spec.server_args
    ctx = zmq.Context()
    reports = ctx.socket(zmq.PUSH)
    reports.connect(spec.endpoints.launcher)
    tokenizer = None
    if Path(args.model).expanduser().is_dir():
        tokenizer = _load_tokenizer(args.model, reports, args.chat_template)
        if tokenizer is None:
            return
    pull = ctx.socket(zmq.PULL)
    pull.bind(spec.endpoints.tokenizer_in)
    push = ctx.socket(zmq.PUSH)
    push.connect(spec.endpoints.scheduler_in)
    ready = _wait_scheduler_ready(spec, pull)
    if ready is None:
        return
    if tokenizer is None:
        tokenizer = _load_tokenizer(args.model, reports, args.chat_template)
        if tokenizer is None:
            return
    router = _bind_public(ctx, args.host, args.port, reports)
    if router is None:
        return
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    server = TokenizerServer(
        tokenizer,
        ready,
        args.max_message_bytes,
        router,
        push,
        args.control_timeout_s,
        max_prompt_chars=args.max_prompt_chars,
    )
    report(reports, p.ProcessReady("tokenizer", os.getpid(), endpoint))
    logger.info("serving on %s", endpoint)
    serve_tokenizer(server, pull, lambda: keep_running(spec))
    stop = stop_message(spec)  # the launcher died or SIGTERM: answer every request in flight (none after Shutdown)
    server.fail_all(stop.code, stop.reason)
    ctx.destroy(linger=LINGER_MS)  # closes every socket once those answers are sent (1 s at most)


def _load_tokenizer(model: str, reports: zmq.Socket, chat_template: str | None = None) -> Any:
    """The model's tokenizer (its chat template replaced by the file chat_template names, if any), or None after
    reporting ProcessFailed."""
    try:
        from runtime.model.loader import load_tokenizer
        from runtime.text.chat_templates import override_chat_template

        return override_chat_template(load_tokenizer(model), chat_template)
    except Exception as exc:
        logger.exception("tokenizer failed to load")
        report(reports, p.ProcessFailed("tokenizer", os.getpid(), one_line(exc)))
        reports.close(linger=2000)
        return None


def _wait_scheduler_ready(spec: ChildSpec, pull: zmq.Socket) -> p.Ready | None:
    """The worker's Ready once the scheduler forwards it (SchedulerReady); None on Shutdown or when the launcher is
    gone first."""
    decoder = msgspec.msgpack.Decoder(p.TokenizerInput)
    while keep_running(spec):
        if not pull.poll(POLL_MS):
            continue
        msg = decoder.decode(pull.recv())
        if isinstance(msg, p.SchedulerReady):
            return msg.worker
        if isinstance(msg, p.Shutdown):
            return None
    return None


def _bind_public(ctx: zmq.Context, host: str, port: int, reports: zmq.Socket) -> zmq.Socket | None:
    """The public ROUTER bound on tcp://host:port (ROUTER_MANDATORY: a send to a vanished client fails, so its
    requests are aborted); None after reporting ProcessFailed("cannot bind ...")."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, ROUTER_SNDHWM)
    router.setsockopt(zmq.LINGER, LINGER_MS)
    try:
        router.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError as exc:
        message = f"cannot bind tcp://{host}:{port}: {zmq_reason(exc)}"
        report(reports, p.ProcessFailed("tokenizer", os.getpid(), message))
        reports.close(linger=2000)
        return None
    return router
