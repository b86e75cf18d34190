"""The tokenizer process loop: the public ROUTER endpoint in front of the scheduler (ARCHITECTURE.md).

Per client frame: decode strictly (runtime.protocol.decode_client_frame), validate, apply the chat template, tokenize,
check the prompt (runtime.prompt_check, as the Engine and the scheduler do), forward a TokenizedRequest to the
scheduler under an internal rid. Per TokenOutput from the scheduler: feed the completion's CompletionStream
(runtime.tokenizer, the Engine's text path: incremental detokenization, stop strings with hold-back; on a stop string it
sends Stop(rid, index, keep_tokens) so the scheduler caches no block past the kept tokens), and send StreamChunks to the
client's identity (streamed: every non-empty delta; non-streamed: one chunk per completion when it ends). A client
that vanished (the ROUTER_MANDATORY send fails; Heartbeats probe quiet clients) has its requests aborted. Every bad
input is answered with an ErrorResponse and the loop goes on. The loop blocks on zmq.Poller with a timeout and exits
when the launcher dies or says Shutdown.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from runtime import protocol as p
from runtime.prompt_check import check_prompt
from runtime.request import RequestRejected
from runtime.serve.frontend import ClientFrontend
from runtime.serve.process import POLL_MS
from runtime.tokenizer import ChatTemplateError, CompletionStream, encode_prompt

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.25  # a client with requests in flight and nothing sent for this long is probed


@dataclass
class _Request:
    identity: bytes
    rid: str  # the client's rid
    stream: bool
    completions: list[CompletionStream]


class TokenizerServer:
    """The tokenizer process's state and handlers; sockets are passed in so tests can drive it in process.

    router: the public ROUTER (ROUTER_MANDATORY set). to_scheduler: PUSH to the scheduler. ready: the worker's Ready
    (max_model_len for the context check, vocab_size for the token-id check). Mutates: its request tables.
    """

    def __init__(self, tokenizer: Any, ready: p.Ready, max_message_bytes: int, router: zmq.Socket,
                 to_scheduler: zmq.Socket) -> None:
        self.tokenizer, self.ready, self.max_message_bytes = tokenizer, ready, max_message_bytes
        self.router, self.to_scheduler = router, to_scheduler
        self.requests: dict[str, _Request] = {}  # internal rid -> request
        self.by_client: dict[tuple[bytes, str], str] = {}  # (identity, client rid) -> internal rid
        self.control: dict[str, tuple[bytes, str]] = {}  # internal rid of a health/stats request -> client
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
        """Forgets a request and tells the scheduler to free its blocks."""
        req = self.requests.pop(internal, None)
        if req is not None:
            self.by_client.pop((req.identity, req.rid), None)
            self.to_scheduler.send(self._encoder.encode(p.AbortRequest(internal)))

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
            self.clients.waiting(identity, time.monotonic())
            self.to_scheduler.send(self._encoder.encode(type(msg)(internal)))

    def _new_rid(self) -> str:
        self._next_rid += 1
        return str(self._next_rid)

    def on_generate(self, identity: bytes, req: p.GenerateRequest) -> None:
        """Validates and tokenizes a GenerateRequest, then forwards it; errors go back as ErrorResponse."""
        try:
            input_ids = self.tokenize(identity, req)
        except RequestRejected as exc:
            self.clients.send(identity, p.ErrorResponse(req.rid, exc.code, str(exc)))
            return
        sp = req.sampling_params
        completions = [CompletionStream(self.tokenizer, sp, self.ready.eos_token_ids) for _ in range(sp.n)]
        internal = self._new_rid()
        self.requests[internal] = _Request(identity, req.rid, req.stream, completions)
        self.by_client[(identity, req.rid)] = internal
        self.clients.waiting(identity, time.monotonic())
        msg = p.TokenizedRequest(rid=internal, input_ids=input_ids, sampling_params=sp, cache_salt=req.cache_salt)
        self.to_scheduler.send(self._encoder.encode(msg))

    def tokenize(self, identity: bytes, req: p.GenerateRequest) -> list[int]:
        """The prompt's token ids. Raises RequestRejected (code, message) for any request this server cannot serve."""
        problem = req.check()
        if problem:
            raise RequestRejected(p.ERR_INVALID, problem)
        if (identity, req.rid) in self.by_client:
            raise RequestRejected(p.ERR_DUPLICATE, f"a request with rid {req.rid!r} is already in flight")
        try:
            ids = encode_prompt(self.tokenizer, req.prompt, req.messages, req.input_ids)
        except ChatTemplateError as exc:
            raise RequestRejected(p.ERR_INVALID, str(exc)) from None
        r = self.ready
        prompt_problem = check_prompt(ids, r.max_model_len, r.vocab_size, r.block_size, r.num_blocks)
        if prompt_problem is not None:
            raise RequestRejected(*prompt_problem)
        return ids

    # ---- scheduler side ------------------------------------------------------------------------------------------

    def on_scheduler_message(self, msg: Any) -> bool:
        """Handles one message from the tokenizer_in PULL; False when the process must stop (Shutdown)."""
        if isinstance(msg, p.TokenOutputs):
            for out in msg.outputs:
                self.on_output(out)
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
                self.clients.send(req.identity, p.StreamChunk(
                    rid=req.rid, index=out.index, text=delta.text, token_ids=delta.token_ids,
                    logprobs=delta.logprobs, finish_reason=delta.finish_reason, usage=delta.usage))
        elif delta.finish_reason is not None:
            self.clients.send(req.identity, p.StreamChunk(
                rid=req.rid, index=out.index, text=stream.text, token_ids=stream.token_ids, logprobs=stream.logprobs,
                finish_reason=delta.finish_reason, usage=delta.usage))
        if delta.finish_reason is not None and all(c.finish_reason is not None for c in req.completions):
            self.abort_quietly(out.rid)

    def heartbeat(self, now: float) -> None:
        """Heartbeats clients waiting on a request or a control request (runtime.serve.frontend.ClientFrontend)."""
        waiting = [req.identity for req in self.requests.values()] + [ident for ident, _ in self.control.values()]
        self.clients.heartbeat(waiting, now)


def serve_tokenizer(server: TokenizerServer, from_scheduler: zmq.Socket, alive) -> None:
    """The loop: client frames and scheduler messages until Shutdown or alive() is False. Never raises on input."""
    decoder = msgspec.msgpack.Decoder(p.TokenizerInput)
    poller = zmq.Poller()
    poller.register(server.router, zmq.POLLIN)
    poller.register(from_scheduler, zmq.POLLIN)
    while alive():
        events = dict(poller.poll(POLL_MS))
        if from_scheduler in events:
            for _ in range(64):
                try:
                    frame = from_scheduler.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = decoder.decode(frame)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    logger.error("dropping an undecodable internal frame: %s", exc)
                    continue
                if not server.on_scheduler_message(msg):
                    return
        if server.router in events:
            for _ in range(64):
                try:
                    frames = server.router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    server.on_client_frames(frames)
                except Exception:  # a bug must not take the endpoint down: answer and go on
                    logger.exception("failed to handle a client message")
                    _answer_internal_error(server, frames)
        if server.requests:
            server.heartbeat(time.monotonic())


def _answer_internal_error(server: TokenizerServer, frames: list[bytes]) -> None:
    """The last-resort answer to a client frame whose handling raised: ErrorResponse(ERR_SERVER) to its identity.
    Never raises (the client may be gone, the frame may have no identity); a failure to answer is only logged."""
    try:
        if frames:
            server.clients.send(frames[0], p.ErrorResponse("", p.ERR_SERVER, "internal error handling the request"))
    except Exception:
        logger.exception("could not answer a client after an internal error")


def _load_tokenizer(model: str, reports: zmq.Socket) -> Any:
    """The model's tokenizer, or None after reporting ProcessFailed."""
    from runtime.serve.process import report

    try:
        from runtime.model.loader import load_tokenizer

        return load_tokenizer(model)
    except Exception as exc:
        logger.exception("tokenizer failed to load")
        report(reports, p.ProcessFailed("tokenizer", os.getpid(), f"{type(exc).__name__}: {exc}"))
        reports.close(linger=2000)
        return None


def run_tokenizer_process(spec) -> None:
    """Tokenizer process entry (spec: runtime.serve.process.ChildSpec). Binds the public endpoint once the scheduler is
    ready, reports ProcessReady(endpoint) to the launcher, serves until Shutdown or the launcher dies.

    A model folder's tokenizer loads while the worker loads the weights; an embedded name or a GGUF file's loads
    after the worker is ready, so a first run converts the GGUF file once, not in two processes at the same time."""
    from runtime.serve.process import parent_alive, report

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
    while ready is None and parent_alive(spec):
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
        report(reports, p.ProcessFailed("tokenizer", os.getpid(), f"cannot bind tcp://{args.host}:{args.port}: "
                                                                 f"{exc.strerror}"))
        reports.close(linger=2000)
        return
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    server = TokenizerServer(tokenizer, ready, args.max_message_bytes, router, push)
    report(reports, p.ProcessReady("tokenizer", os.getpid(), endpoint))
    logger.info("serving on %s", endpoint)
    serve_tokenizer(server, pull, lambda: parent_alive(spec))
    router.close(linger=1000)
