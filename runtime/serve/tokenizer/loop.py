"""The tokenizer process loop: scheduler messages, prepared prompts and client frames through one TokenizerServer.

Each input kind has a guarded step that never lets a handler's exception out, so no input can end the public endpoint:
a client frame whose handling raised is answered ERR_SERVER (answer_internal_error), a request whose output fails is
failed alone (TokenizerServer.fail_request). The loop blocks on zmq.Poller with a timeout (an idle server uses no CPU)
and exits when alive() turns False or the scheduler side says Shutdown.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from runtime import protocol as p
from runtime.protocol.client_frame import frame_rid
from runtime.serve.process import POLL_MS
from runtime.serve.tokenizer.server import TokenizerServer

logger = logging.getLogger(__name__)

CLIENT_SLICE_S = 0.05  # the loop reads client frames this long at most before it serves the scheduler side again
DRAIN_MAX = 64  # messages read from one socket per loop iteration at most


def serve_tokenizer(server: TokenizerServer, from_scheduler: zmq.Socket, alive: Callable[[], bool]) -> None:
    """Runs the loop until Shutdown or alive() is False: scheduler messages, prepared prompts (PromptWorker.fd),
    client frames, then control timeouts and heartbeats. Never raises on input."""
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
        if server.waiting():
            guarded("heartbeat", server.heartbeat, now)


def guarded(what: str, handler: Callable[..., Any], *args: Any) -> None:
    """handler(*args); an exception is logged, never raised (the loop must outlive any handler's bug)."""
    try:
        handler(*args)
    except Exception:
        logger.exception("the tokenizer loop's %s handler failed; going on", what)


def drain_scheduler(server: TokenizerServer, sock: zmq.Socket, decoder: msgspec.msgpack.Decoder) -> bool:
    """Handles up to DRAIN_MAX waiting scheduler messages; False once Shutdown arrived."""
    for _ in range(DRAIN_MAX):
        try:
            frame = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            break
        try:
            msg = decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.error("dropping an undecodable internal frame: %s", exc)
            continue
        try:
            if not server.on_scheduler_message(msg):
                return False
        except Exception:
            logger.exception("failed to handle a scheduler message (%s)", type(msg).__name__)
            if isinstance(msg, p.Shutdown):
                return False
    return True


def drain_clients(server: TokenizerServer) -> None:
    """Handles waiting client frames: DRAIN_MAX at most, for CLIENT_SLICE_S at most."""
    start = time.monotonic()
    for _ in range(DRAIN_MAX):
        try:
            frames = server.router.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        try:
            server.on_client_frames(frames)
        except Exception:  # a bug must not take the endpoint down: answer and go on
            logger.exception("failed to handle a client message")
            answer_internal_error(server, frames)
        if time.monotonic() - start > CLIENT_SLICE_S:
            break


def answer_internal_error(server: TokenizerServer, frames: list[bytes]) -> None:
    """The last-resort answer to a client frame whose handling raised: ErrorResponse(ERR_SERVER) to its identity,
    with the frame's rid when it is a map with a string "rid" of at most MAX_RID_CHARS characters. Cannot raise (the
    client may be gone, the frame may have no identity, the frontend itself may be broken): a failure to answer is
    only logged."""
    try:
        rid = ""
        if len(frames) == 2:
            rid = frame_rid(frames[1])
        server.clients.send(frames[0], p.ErrorResponse(rid, p.ERR_SERVER, "internal error handling the request"))
    except Exception:
        try:
            logger.exception("could not answer a client after an internal error")
        except Exception:
            pass
