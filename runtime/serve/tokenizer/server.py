"""TokenizerServer: the tokenizer process's handlers, between the public ROUTER and the scheduler
(docs/ARCHITECTURE.md).

Per client frame: decode strictly (runtime.protocol.decode_client_frame: what crosses the public socket is validated
there, SamplingParams included, and nowhere again in this process), bound the text's size (PromptPrep.precheck), then
apply the chat template, tokenize and check the prompt (PromptPrep.prepare) on the PromptWorker thread, so a large
prompt never stalls the loop (a small one is prepared in place), and forward a TokenizedRequest to the scheduler under
an internal rid. Per TokenOutput from the scheduler: feed the completion's CompletionStream (runtime.text, the
Engine's text path: incremental detokenization, stop strings with hold-back; on a stop string it sends Stop(rid,
index, keep_tokens) so the scheduler caches no block past the kept tokens), and send StreamChunks to the client's
identity (streamed: every non-empty delta; non-streamed: one chunk per completion when it ends). A TokenizeRequest or
DetokenizeRequest is checked on the loop and answered from this process's tokenizer (TextRequests), on the
PromptWorker thread unless it is cheap, in the client's order with its prompts; the scheduler never sees it. A client
that vanished (the ROUTER_MANDATORY send fails; Heartbeats probe quiet clients) has its requests aborted. Every bad
input is answered with an ErrorResponse.

Parts, each given what it needs in the constructor: InFlight / ControlRequests (what is in flight), PromptPrep (the
prompt path), TextRequests (tokenize and detokenize answers), PromptWorker (the tokenizing thread), ClientFrontend
(replies and heartbeats). The loop that drives the
handlers is runtime.serve.tokenizer.loop; the process entry is runtime.serve.tokenizer.process.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import msgspec
import zmq

from runtime import protocol as p
from runtime.scheduler.request import RequestRejected
from runtime.serve.tokenizer.frontend import ClientFrontend
from runtime.serve.tokenizer.in_flight import ClientRef, ClientRequest, ControlRequests, InFlight
from runtime.serve.tokenizer.prompt_prep import Prepared, PromptPrep
from runtime.serve.tokenizer.prompt_worker import PromptResult, PromptWorker, run_job
from runtime.serve.tokenizer.text_requests import TextRequest, TextRequests
from runtime.text.completion_stream import CompletionDelta, CompletionStream

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.25  # a client with requests in flight and nothing sent for this long is probed


class TokenizerServer:
    """The tokenizer process's state and handlers; sockets are passed in so tests can drive it in process.

    tokenizer: the model's transformers tokenizer. router: the public ROUTER (ROUTER_MANDATORY set). to_scheduler: PUSH
    to the scheduler. ready: the worker's Ready (max_model_len for the context check, vocab_size for the token-id
    check). max_message_bytes: the largest client frame (bytes; ERR_TOO_LARGE above). control_timeout_s: seconds a
    health / stats / KV snapshot request waits for the scheduler before it is answered ErrorResponse(ERR_SERVER).
    max_prompt_chars: ServerArgs' (runtime.prompt_check.prompt_char_limit). Prompts are tokenized on a PromptWorker
    thread: a generate request is answered (forwarded or ErrorResponse) when the loop, or an in-process driver, calls
    finish_prompts; so is a tokenize / detokenize request that is not cheap (text_clients: its key -> its client,
    until then). Mutates: in_flight, control, text_clients. close() stops the thread.
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
        self.ready = ready
        self.max_message_bytes = max_message_bytes
        self.router = router
        self.to_scheduler = to_scheduler
        self.prep = PromptPrep(tokenizer, ready, max_prompt_chars)
        self.text = TextRequests(tokenizer, self.prep.prompt_chars)
        self.text_clients: dict[str, ClientRef] = {}
        self.prompts = PromptWorker()
        self.in_flight = InFlight()
        self.control = ControlRequests(control_timeout_s)
        self.clients = ClientFrontend(self.drop_client, HEARTBEAT_S, router)
        self._next_rid = 0
        self._encoder = msgspec.msgpack.Encoder()

    # ---- client side ---------------------------------------------------------------------------------------------

    def drop_client(self, identity: bytes) -> None:
        """Aborts every request of a vanished client (ClientFrontend's on_gone), its tokenize / detokenize requests
        included (a queued one does not run)."""
        for internal in self.in_flight.of_client(identity):
            self.abort(internal)
        for key, client in list(self.text_clients.items()):
            if client.identity == identity:
                del self.text_clients[key]
                self.prompts.cancel(key)

    def abort(self, internal: str) -> None:
        """Forgets a request and tells the scheduler to free its blocks (a request still being tokenized is never
        forwarded: its prompt is dropped when it is ready)."""
        req = self.in_flight.pop(internal)
        if req is None:
            return
        if req.forwarded:
            self._to_scheduler(p.AbortRequest(internal))
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
            internal = self.in_flight.internal_of(identity, msg.rid)
            if internal is not None:
                self.abort(internal)
        elif isinstance(msg, (p.TokenizeRequest, p.DetokenizeRequest)):
            self.on_text_request(identity, msg)
        else:  # health / stats / kv snapshot: answered by the scheduler
            internal = self._new_rid()
            now = time.monotonic()
            self.control.add(internal, ClientRef(identity, msg.rid), now)
            self.clients.waiting(identity, now)
            self._to_scheduler(type(msg)(internal))

    def _new_rid(self) -> str:
        self._next_rid += 1
        return str(self._next_rid)

    def on_generate(self, identity: bytes, req: p.GenerateRequest) -> None:
        """Checks a decoded GenerateRequest (O(fields): well formed, rid not in flight, text within the character
        limit) and prepares its prompt: here when it is cheap and the client has none queued, else on the PromptWorker
        (on_prepared forwards it); errors go back as ErrorResponse."""
        try:
            self.prep.precheck(req)
            if self.in_flight.internal_of(identity, req.rid) is not None:  # in flight, or still being tokenized
                raise RequestRejected(p.ERR_DUPLICATE, f"a request with rid {req.rid!r} is already in flight")
        except RequestRejected as exc:
            self.clients.send(identity, p.ErrorResponse(req.rid, exc.code, str(exc)))
            return
        internal = self._new_rid()
        self.in_flight.add(internal, identity, req.rid, req.stream)
        self.clients.waiting(identity, time.monotonic())
        job = functools.partial(self.prep.prepare, internal, req)
        try:
            if self.prep.cheap(req) and not self.prompts.busy(identity):  # a few ms, and the client's order is kept
                self.on_prepared(run_job(internal, identity, job))
            else:
                self.prompts.submit(internal, identity, job)
        except Exception:  # answered ERR_SERVER by the loop (runtime.serve.tokenizer.loop): leave no record behind
            self.in_flight.pop(internal)
            raise

    def on_text_request(self, identity: bytes, req: TextRequest) -> None:
        """Checks a tokenize / detokenize request (O(fields + messages)) and answers it: here when it is cheap and the
        client has no prompt queued, else on the PromptWorker (on_prepared answers it); errors go back as
        ErrorResponse."""
        try:
            self.text.check(req)
        except RequestRejected as exc:
            self.clients.send(identity, p.ErrorResponse(req.rid, exc.code, str(exc)))
            return
        key = self._new_rid()
        self.text_clients[key] = ClientRef(identity, req.rid)
        self.clients.waiting(identity, time.monotonic())
        job = functools.partial(self.text.answer, req)
        try:
            if self.text.cheap(req) and not self.prompts.busy(identity):
                self.on_prepared(run_job(key, identity, job))
            else:
                self.prompts.submit(key, identity, job)
        except Exception:  # answered ERR_SERVER by the loop: leave no record behind
            self.text_clients.pop(key, None)
            raise

    def on_prepared(self, result: PromptResult) -> None:
        """Forwards a prepared prompt as TokenizedRequest, or answers its rejection; drops it when the request was
        aborted (or its client vanished) meanwhile. A tokenize / detokenize job's result is sent to its client."""
        client = self.text_clients.pop(result.key, None)
        if client is not None:
            self._answer_text(client, result)
            return
        pending = self.in_flight.get(result.key)
        if pending is None or pending.forwarded:
            return
        prepared = result.value
        error = result.error
        if error is not None or not isinstance(prepared, Prepared):
            self.in_flight.pop(result.key)
            if not isinstance(error, RequestRejected):
                logger.error("preparing request %s failed", result.key, exc_info=error)
                error = RequestRejected(p.ERR_SERVER, f"internal error preparing the prompt: {error!r}")
            self.clients.send(pending.identity, p.ErrorResponse(pending.rid, error.code, str(error)))
            return
        pending.completions = prepared.completions
        pending.forwarded = True
        self._to_scheduler(prepared.message)

    def _answer_text(self, client: ClientRef, result: PromptResult) -> None:
        """Sends a tokenize / detokenize job's answer, or its rejection, to client."""
        answer = result.value
        if result.error is None and isinstance(answer, (p.TokenizeResponse, p.DetokenizeResponse)):
            self.clients.send(client.identity, answer)
            return
        error = result.error
        if not isinstance(error, RequestRejected):
            logger.error("answering tokenize / detokenize request %s failed", result.key, exc_info=error)
            error = RequestRejected(p.ERR_SERVER, f"internal error: {error!r}")
        self.clients.send(client.identity, p.ErrorResponse(client.rid, error.code, str(error)))

    def finish_prompts(self, timeout_s: float = 0.0) -> int:
        """Handles every prompt the PromptWorker has finished (the loop calls it when PromptWorker.fd is readable);
        timeout_s > 0 first waits that long at most for every queued prompt (for in-process drivers). Returns how
        many were handled."""
        if timeout_s > 0:
            results = self.prompts.wait(timeout_s)
        else:
            results = self.prompts.results()
        for result in results:
            self.on_prepared(result)
        return len(results)

    # ---- scheduler side ------------------------------------------------------------------------------------------

    def on_scheduler_message(self, msg: p.TokenizerInput) -> bool:
        """Handles one message from the tokenizer_in PULL; False when the process must stop (Shutdown)."""
        if isinstance(msg, p.TokenOutputs):
            for out in msg.outputs:
                try:
                    self.on_output(out)
                except Exception:  # one request's failure (a bug, a tokenizer error) fails that request only
                    logger.exception("failed to handle an output of request %s", out.rid)
                    self.fail_request(out.rid, p.ERR_SERVER, "internal error handling the request's output")
        elif isinstance(msg, p.RequestFailed):
            req = self.in_flight.pop(msg.rid)  # the scheduler already ended it: no Abort
            if req is not None:
                self.clients.send(req.identity, p.ErrorResponse(req.rid, msg.code, msg.message))
        elif isinstance(msg, (p.HealthResponse, p.StatsResponse, p.KvSnapshotResponse)):
            client = self.control.pop(msg.rid)
            if client is not None:
                self.clients.send(client.identity, msgspec.structs.replace(msg, rid=client.rid))
        elif isinstance(msg, p.Shutdown):
            self.fail_all(msg.code, msg.reason)
            return False
        return True

    def fail_request(self, internal: str, code: str, message: str) -> None:
        """Aborts a request (the scheduler frees its blocks) and answers its client ErrorResponse(code, message).
        Never raises: a failure is logged."""
        try:
            req = self.in_flight.get(internal)
            if req is not None:
                self.abort(internal)
                self.clients.send(req.identity, p.ErrorResponse(req.rid, code, message))
        except Exception:
            logger.exception("could not fail request %s", internal)

    def close(self) -> None:
        """Stops the PromptWorker thread (prompts still queued are dropped)."""
        self.prompts.close()

    def fail_all(self, code: str, reason: str) -> None:
        """Answers every request, control request and tokenize / detokenize request in flight with
        ErrorResponse(code, reason)."""
        for internal in list(self.in_flight.requests):
            req = self.in_flight.pop(internal)
            if req is not None:
                self.clients.send(req.identity, p.ErrorResponse(req.rid, code, reason))
        for client in self.control.clear():
            self.clients.send(client.identity, p.ErrorResponse(client.rid, code, reason))
        for key, client in list(self.text_clients.items()):
            del self.text_clients[key]
            self.prompts.cancel(key)
            self.clients.send(client.identity, p.ErrorResponse(client.rid, code, reason))

    def on_output(self, out: p.TokenOutput) -> None:
        """Feeds one TokenOutput to its CompletionStream; sends the delta (stream) or, once the completion ends, the
        whole completion (non-stream); a stop string sends Stop(keep_tokens) to the scheduler."""
        req = self.in_flight.get(out.rid)
        if req is None:
            return  # aborted, failed or already answered
        completion = req.completions[out.index]
        delta = completion.feed(out)
        if delta.stop_keep_tokens is not None:  # the scheduler still runs it: finish it keeping only these tokens
            self._to_scheduler(p.Stop(out.rid, out.index, delta.stop_keep_tokens))
        chunk = _chunk(req, out, delta, completion)
        if chunk is not None:
            self.clients.send(req.identity, chunk)
        if delta.finish_reason is not None and all(c.finish_reason is not None for c in req.completions):
            self.in_flight.pop(out.rid)

    def expire_control(self, now: float) -> None:
        """Answers every control request the scheduler left unanswered for control_timeout_s seconds with
        ErrorResponse(ERR_SERVER); a late answer is then dropped. O(expired)."""
        for client in self.control.expire(now):
            message = f"the scheduler did not answer within {self.control.timeout_s} s"
            self.clients.send(client.identity, p.ErrorResponse(client.rid, p.ERR_SERVER, message))

    def waiting(self) -> bool:
        """True while a request, a control request or a tokenize / detokenize request is in flight (the loop then
        heartbeats)."""
        return bool(self.in_flight.requests or self.control.clients or self.text_clients)

    def heartbeat(self, now: float) -> None:
        """Heartbeats clients waiting on a request or a control request
        (runtime.serve.tokenizer.frontend.ClientFrontend)."""
        waiting = self.in_flight.identities() + [client.identity for client in self.control.clients.values()]
        waiting += [client.identity for client in self.text_clients.values()]
        self.clients.heartbeat(waiting, now)

    def _to_scheduler(self, msg: p.SchedulerInput) -> None:
        self.to_scheduler.send(self._encoder.encode(msg))


def _chunk(
    req: ClientRequest, out: p.TokenOutput, delta: CompletionDelta, completion: CompletionStream
) -> p.StreamChunk | None:
    """The StreamChunk one output sends: streamed, the delta (None when it is empty); not streamed, the whole
    completion once it ends (None before)."""
    if req.stream:
        if delta.empty:
            return None
        text = delta.text
        token_ids = delta.token_ids
        logprobs = delta.logprobs
        token_texts = delta.token_texts
        prompt = delta.prompt_logprobs
        prompt_texts = delta.prompt_token_texts
    else:
        if delta.finish_reason is None:
            return None
        text = completion.text
        token_ids = completion.token_ids
        logprobs = completion.logprobs
        token_texts = completion.token_texts
        prompt = completion.prompt_logprobs
        prompt_texts = completion.prompt_token_texts
    return p.StreamChunk(
        rid=req.rid,
        index=out.index,
        text=text,
        token_ids=token_ids,
        logprobs=logprobs,
        token_texts=token_texts,
        finish_reason=delta.finish_reason,
        usage=delta.usage,
        score=out.score,
        prompt_logprobs=None if prompt is None else p.PromptChunk(prompt, prompt_texts),
    )
