"""The tokenizer process loop: the public ROUTER endpoint in front of the scheduler (ARCHITECTURE.md).

Per client frame: decode strictly (runtime.protocol.decode_client_frame), validate and bound the text's size
(runtime.serve.tokenizer.prompt_prep), then apply the chat template, tokenize and check the prompt
(runtime.prompt_check, as the Engine and the scheduler do) on the PromptWorker thread, so a large prompt never stalls
the loop (a small one is prepared in place), and forward a TokenizedRequest to the scheduler under an internal rid. Per
TokenOutput from the scheduler: feed the completion's CompletionStream (runtime.text, the Engine's text path:
incremental detokenization, stop strings with hold-back; on a stop string it sends Stop(rid, index, keep_tokens) so the
scheduler caches no block past the kept tokens), and send StreamChunks to the client's identity (streamed: every
non-empty delta; non-streamed: one chunk per completion when it ends). A client that vanished (the ROUTER_MANDATORY send
fails; Heartbeats probe quiet clients) has its requests aborted. Every bad input is answered with an ErrorResponse and
the loop goes on; no handler's exception ends it (runtime.serve.tokenizer.loop). The loop blocks on zmq.Poller with a
timeout and exits when the launcher dies or says Shutdown.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from runtime import protocol as p
from runtime.scheduler.request import RequestRejected
from runtime.serve.process import POLL_MS
from runtime.serve.tokenizer.frontend import ClientFrontend
from runtime.serve.tokenizer.loop import drain_clients, drain_scheduler, guarded
from runtime.serve.tokenizer.prompt_prep import Prepared, PromptPrep
from runtime.serve.tokenizer.prompt_worker import PromptResult, PromptWorker, run_job
from runtime.text.completion_stream import CompletionStream

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.25  # a client with requests in flight and nothing sent for this long is probed


@dataclass
class _Request:
    identity: bytes
    rid: str  # the client's rid
    stream: bool
    completions: list[CompletionStream]  # set when its prompt is prepared
    forwarded: bool = False  # False while its prompt is tokenized on the PromptWorker: the scheduler does not know it


class TokenizerServer:
    """The tokenizer process's state and handlers; sockets are passed in so tests can drive it in process.

    router: the public ROUTER (ROUTER_MANDATORY set). to_scheduler: PUSH to the scheduler. ready: the worker's Ready
    (max_model_len for the context check, vocab_size for the token-id check). control_timeout_s: seconds a health /
    stats / KV snapshot request waits for the scheduler before it is answered ErrorResponse(ERR_SERVER) (a frozen
    scheduler must not leave it waiting forever). max_prompt_chars: ServerArgs' (runtime.prompt_check.
    prompt_char_limit). Prompts are tokenized on a PromptWorker thread: a generate request is answered (forwarded or
    ErrorResponse) when the loop, or an in-process driver, calls finish_prompts. Mutates: its request tables.
    close() stops the thread.
    """

    def __init__(
        self,
        tokenizer: Any,
        ready: p.Ready,
        max_message_bytes: int,
        router: zmq.Socket,
        to_scheduler: zmq.Socket,
        control_timeout_s: float = 10.0,
        *,
        max_prompt_chars: int | None = None,
    ) -> None:
        self.tokenizer, self.ready, self.max_message_bytes = tokenizer, ready, max_message_bytes
        self.router, self.to_scheduler = router, to_scheduler
        self.prep = PromptPrep(tokenizer, ready, max_prompt_chars)
        self.prompts = PromptWorker()
        self.requests: dict[str, _Request] = {}  # internal rid -> request
        self.by_client: dict[tuple[bytes, str], str] = {}  # (identity, client rid) -> internal rid
        self.control: dict[str, tuple[bytes, str]] = {}  # internal rid of a health/stats request -> client
        self.control_timeout_s = control_timeout_s
        self.control_deadlines: deque[tuple[float, str]] = deque()  # (deadline, internal rid), in deadline order
        self.clients = ClientFrontend(self.drop_client, HEARTBEAT_S, router)
        self._next_rid = 0
        self._encoder = msgspec.msgpack.Encoder()

    # ---- client side ---------------------------------------------------------------------------------------------

    def drop_client(self, identity: bytes) -> None:
        """Aborts every request of a vanished client (ClientFrontend's on_gone)."""
        for (ident, _rid), internal in list(self.by_client.items()):
            if ident == identity:
                self.abort(internal)

    def abort(self, internal: str) -> None:
        """Forgets a request and tells the scheduler to free its blocks (a request still being tokenized is never
        forwarded: its prompt is dropped when it is ready)."""
        req = self.requests.pop(internal, None)
        if req is not None:
            self.by_client.pop((req.identity, req.rid), None)
            if req.forwarded:
                self.to_scheduler.send(self._encoder.encode(p.AbortRequest(internal)))
            else:
                self.prompts.cancel(internal)

    def on_client_frames(self, frames: list[bytes]) -> None:
        """Handles one message from the ROUTER: [identity, payload]."""
        identity = frames[0]
        if len(frames) != 2:
            error = p.ErrorResponse("", p.ERR_MALFORMED, f"expected 1 frame, got {len(frames) - 1}")
            self.clients.send(identity, error)
            return
        msg = p.decode_client_frame(frames[1], self.max_message_bytes)
        if isinstance(msg, p.ErrorResponse):
            self.clients.send(identity, msg)
        elif isinstance(msg, p.GenerateRequest):
            self.on_generate(identity, msg)
        elif isinstance(msg, p.AbortRequest):
            internal = self.by_client.get((identity, msg.rid))
            if internal is not None:
                self.abort(internal)
        else:  # health / stats / kv snapshot: answered by the scheduler
            internal = self._new_rid()
            self.control[internal] = (identity, msg.rid)
            self.control_deadlines.append((time.monotonic() + self.control_timeout_s, internal))
            self.clients.waiting(identity, time.monotonic())
            self.to_scheduler.send(self._encoder.encode(type(msg)(internal)))

    def _new_rid(self) -> str:
        self._next_rid += 1
        return str(self._next_rid)

    def on_generate(self, identity: bytes, req: p.GenerateRequest) -> None:
        """Checks a GenerateRequest (O(fields): well formed, rid not in flight, text within the character limit) and
        prepares its prompt: here when it is cheap and the client has none queued, else on the PromptWorker
        (on_prepared forwards it); errors go back as ErrorResponse."""
        try:
            self.prep.precheck(req)
            if (identity, req.rid) in self.by_client:  # in flight, or still being tokenized
                raise RequestRejected(p.ERR_DUPLICATE, f"a request with rid {req.rid!r} is already in flight")
        except RequestRejected as exc:
            self.clients.send(identity, p.ErrorResponse(req.rid, exc.code, str(exc)))
            return
        internal = self._new_rid()
        self.requests[internal] = _Request(identity, req.rid, req.stream, [])
        self.by_client[(identity, req.rid)] = internal
        self.clients.waiting(identity, time.monotonic())
        job = functools.partial(self.prep.prepare, internal, req)
        try:
            if self.prep.cheap(req) and not self.prompts.busy(identity):  # a few ms, and the client's order is kept
                self.on_prepared(run_job(internal, identity, job))
            else:
                self.prompts.submit(internal, identity, job)
        except Exception:  # answered ERR_SERVER by the loop (tokenizer_loop): leave no record of it behind
            self.abort_quietly(internal)
            raise

    def on_prepared(self, result: PromptResult) -> None:
        """Forwards a prepared prompt as TokenizedRequest, or answers its rejection; drops it when the request was
        aborted (or its client vanished) meanwhile."""
        internal, _identity, prepared, error = result
        pending = self.requests.get(internal)
        if pending is None or pending.forwarded:
            return
        if error is not None or not isinstance(prepared, Prepared):
            self.abort_quietly(internal)
            if not isinstance(error, RequestRejected):
                logger.error("preparing request %s failed", internal, exc_info=error)
                error = RequestRejected(p.ERR_SERVER, f"internal error preparing the prompt: {error!r}")
            self.clients.send(pending.identity, p.ErrorResponse(pending.rid, error.code, str(error)))
            return
        pending.completions, pending.forwarded = prepared.completions, True
        self.to_scheduler.send(self._encoder.encode(prepared.message))

    def finish_prompts(self, timeout_s: float = 0.0) -> int:
        """Handles every prompt the PromptWorker has finished (the loop calls it when PromptWorker.fd is readable);
        timeout_s > 0 first waits that long at most for every queued prompt (for in-process drivers). Returns how
        many were handled."""
        results = self.prompts.wait(timeout_s) if timeout_s > 0 else self.prompts.results()
        for result in results:
            self.on_prepared(result)
        return len(results)

    # ---- scheduler side ------------------------------------------------------------------------------------------

    def on_scheduler_message(self, msg: Any) -> bool:
        """Handles one message from the tokenizer_in PULL; False when the process must stop (Shutdown)."""
        if isinstance(msg, p.TokenOutputs):
            for out in msg.outputs:
                try:
                    self.on_output(out)
                except Exception:  # one request's failure (a bug, a tokenizer error) fails that request only
                    logger.exception("failed to handle an output of request %s", out.rid)
                    self.fail_request(out.rid, p.ERR_SERVER, "internal error handling the request's output")
        elif isinstance(msg, p.RequestFailed):
            req = self.requests.get(msg.rid)
            if req is not None:
                self.abort_quietly(msg.rid)
                self.clients.send(req.identity, p.ErrorResponse(req.rid, msg.code, msg.message))
        elif isinstance(msg, (p.HealthResponse, p.StatsResponse, p.KvSnapshotResponse)):
            client = self.control.pop(msg.rid, None)
            if client is not None:
                self.clients.send(client[0], msgspec.structs.replace(msg, rid=client[1]))
        elif isinstance(msg, p.Shutdown):
            self.fail_all(msg.code, msg.reason)
            return False
        return True

    def fail_request(self, internal: str, code: str, message: str) -> None:
        """Aborts a request (the scheduler frees its blocks) and answers its client ErrorResponse(code, message).
        Never raises: a failure is logged."""
        try:
            req = self.requests.get(internal)
            if req is not None:
                self.abort(internal)
                self.clients.send(req.identity, p.ErrorResponse(req.rid, code, message))
        except Exception:
            logger.exception("could not fail request %s", internal)

    def close(self) -> None:
        """Stops the PromptWorker thread (prompts still queued are dropped)."""
        self.prompts.close()

    def abort_quietly(self, internal: str) -> None:
        """Forgets a request the scheduler already ended (no Abort sent)."""
        req = self.requests.pop(internal, None)
        if req is not None:
            self.by_client.pop((req.identity, req.rid), None)

    def fail_all(self, code: str, reason: str) -> None:
        """Answers every request and control request in flight with ErrorResponse(code, reason)."""
        for internal, req in list(self.requests.items()):
            self.abort_quietly(internal)
            self.clients.send(req.identity, p.ErrorResponse(req.rid, code, reason))
        for identity, rid in self.control.values():
            self.clients.send(identity, p.ErrorResponse(rid, code, reason))
        self.control.clear()

    def on_output(self, out: p.TokenOutput) -> None:
        """Feeds one TokenOutput to its CompletionStream; sends the delta (stream) or, once the completion ends, the
        whole completion (non-stream); a stop string sends Stop(keep_tokens) to the scheduler."""
        req = self.requests.get(out.rid)
        if req is None:
            return  # aborted, failed or already answered
        stream = req.completions[out.index]
        delta = stream.feed(out)
        if delta.stop_keep_tokens is not None:  # the scheduler still runs it: finish it keeping only these tokens
            self.to_scheduler.send(self._encoder.encode(p.Stop(out.rid, out.index, delta.stop_keep_tokens)))
        if req.stream:
            if not delta.empty:
                self.clients.send(
                    req.identity,
                    p.StreamChunk(
                        rid=req.rid,
                        index=out.index,
                        text=delta.text,
                        token_ids=delta.token_ids,
                        logprobs=delta.logprobs,
                        finish_reason=delta.finish_reason,
                        usage=delta.usage,
                        score=out.score,
                    ),
                )
        elif delta.finish_reason is not None:
            self.clients.send(
                req.identity,
                p.StreamChunk(
                    rid=req.rid,
                    index=out.index,
                    text=stream.text,
                    token_ids=stream.token_ids,
                    logprobs=stream.logprobs,
                    finish_reason=delta.finish_reason,
                    usage=delta.usage,
                    score=out.score,
                ),
            )
        if delta.finish_reason is not None and all(c.finish_reason is not None for c in req.completions):
            self.abort_quietly(out.rid)

    def expire_control(self, now: float) -> None:
        """Answers every control request the scheduler left unanswered for control_timeout_s seconds with
        ErrorResponse(ERR_SERVER); a late answer is then dropped. O(expired)."""
        deadlines = self.control_deadlines
        while deadlines and deadlines[0][0] <= now:
            client = self.control.pop(deadlines.popleft()[1], None)
            if client is not None:
                self.clients.send(
                    client[0],
                    p.ErrorResponse(
                        client[1], p.ERR_SERVER, f"the scheduler did not answer within {self.control_timeout_s} s"
                    ),
                )

    def heartbeat(self, now: float) -> None:
        """Heartbeats clients waiting on a request or a control request
        (runtime.serve.tokenizer.frontend.ClientFrontend)."""
        waiting = [req.identity for req in self.requests.values()] + [ident for ident, _ in self.control.values()]
        self.clients.heartbeat(waiting, now)


def serve_tokenizer(server: TokenizerServer, from_scheduler: zmq.Socket, alive) -> None:
    """The loop: scheduler messages, prepared prompts (PromptWorker.fd) and client frames until Shutdown or alive()
    is False. Never raises on input: a handler that raises is logged and the loop goes on (the client frame is
    answered ERR_SERVER; a request whose output fails is failed alone, runtime.serve.tokenizer.process.fail_request).
    """
    decoder = msgspec.msgpack.Decoder(p.TokenizerInput)
    poller = zmq.Poller()
    poller.register(server.router, zmq.POLLIN)
    poller.register(from_scheduler, zmq.POLLIN)
    poller.register(server.prompts.fd, zmq.POLLIN)
    while alive():
        events = dict(poller.poll(POLL_MS))
        if from_scheduler in events and not drain_scheduler(server, from_scheduler, decoder):
            return
        if server.prompts.fd in events:
            guarded("prepared prompts", server.finish_prompts)
        if server.router in events:
            drain_clients(server)
        now = time.monotonic()
        guarded("control timeouts", server.expire_control, now)
        if server.requests or server.control:
            guarded("heartbeat", server.heartbeat, now)


def _load_tokenizer(model: str, reports: zmq.Socket) -> Any:
    """The model's tokenizer, or None after reporting ProcessFailed."""
    from runtime.serve.process import one_line, report

    try:
        from runtime.model.loader import load_tokenizer

        return load_tokenizer(model)
    except Exception as exc:
        logger.exception("tokenizer failed to load")
        report(reports, p.ProcessFailed("tokenizer", os.getpid(), one_line(exc)))
        reports.close(linger=2000)
        return None


def run_tokenizer_process(spec) -> None:
    """Tokenizer process entry (spec: runtime.serve.process.ChildSpec). Binds the public endpoint once the scheduler is
    ready, reports ProcessReady(endpoint) to the launcher, serves until Shutdown or the launcher dies.

    A model folder's tokenizer loads while the worker loads the weights; an embedded name or a GGUF file's loads
    after the worker is ready, so a first run converts the GGUF file once, not in two processes at the same time."""
    from runtime.serve.process import keep_running, report, stop_message, zmq_reason

    args = spec.server_args
    ctx = zmq.Context()
    reports = ctx.socket(zmq.PUSH)
    reports.connect(spec.endpoints.launcher)
    tokenizer = None
    if Path(args.model).expanduser().is_dir():
        tokenizer = _load_tokenizer(args.model, reports)
        if tokenizer is None:
            return
    pull = ctx.socket(zmq.PULL)
    pull.bind(spec.endpoints.tokenizer_in)
    push = ctx.socket(zmq.PUSH)
    push.connect(spec.endpoints.scheduler_in)
    decoder = msgspec.msgpack.Decoder(p.TokenizerInput)
    ready = None
    while ready is None and keep_running(spec):
        if pull.poll(POLL_MS):
            msg = decoder.decode(pull.recv())
            if isinstance(msg, p.SchedulerReady):
                ready = msg.worker
            elif isinstance(msg, p.Shutdown):
                return
    if ready is None:
        return
    if tokenizer is None:
        tokenizer = _load_tokenizer(args.model, reports)
        if tokenizer is None:
            return
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, 100_000)
    router.setsockopt(zmq.LINGER, 1000)
    try:
        router.bind(f"tcp://{args.host}:{args.port}")
    except zmq.ZMQError as exc:
        report(
            reports,
            p.ProcessFailed("tokenizer", os.getpid(), f"cannot bind tcp://{args.host}:{args.port}: {zmq_reason(exc)}"),
        )
        reports.close(linger=2000)
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
    ctx.destroy(linger=1000)  # closes every socket once those answers are sent (1 s at most)
