"""The tokenizer loop's guarded steps (runtime.serve.tokenizer.process.serve_tokenizer): each handles one kind of
input through a TokenizerServer and never lets a handler's exception out, so no input can end the public endpoint.

server is a runtime.serve.tokenizer.process.TokenizerServer (not imported: that module imports this one).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import zmq

from runtime import protocol as p

logger = logging.getLogger(__name__)

CLIENT_SLICE_S = 0.05  # the loop reads client frames this long at most before it serves the scheduler side again


def guarded(what: str, handler, *args) -> None:
    """handler(*args); an exception is logged, never raised (the loop must outlive any handler's bug)."""
    try:
        handler(*args)
    except Exception:
        logger.exception("the tokenizer loop's %s handler failed; going on", what)


def drain_scheduler(server: Any, sock: zmq.Socket, decoder: msgspec.msgpack.Decoder) -> bool:
    """Handles up to 64 waiting scheduler messages; False once Shutdown arrived."""
    for _ in range(64):
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


def drain_clients(server: Any) -> None:
    """Handles waiting client frames: 64 at most, for CLIENT_SLICE_S at most."""
    start = time.monotonic()
    for _ in range(64):
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


class _Rid(msgspec.Struct):
    rid: str = ""


_rid_decoder = msgspec.msgpack.Decoder(_Rid)  # only the rid: msgspec skips every other field


def answer_internal_error(server: Any, frames: list[bytes]) -> None:
    """The last-resort answer to a client frame whose handling raised: ErrorResponse(ERR_SERVER) to its identity,
    with the frame's rid when it is a map with a string "rid". Cannot raise (the client may be gone, the frame may
    have no identity, the frontend itself may be broken): a failure to answer is only logged."""
    try:
        try:
            rid = _rid_decoder.decode(frames[1]).rid if len(frames) == 2 else ""
        except Exception:
            rid = ""
        rid = rid if len(rid) <= p.MAX_RID_CHARS else ""  # never echo an oversized rid
        server.clients.send(frames[0], p.ErrorResponse(rid, p.ERR_SERVER, "internal error handling the request"))
    except Exception:
        try:
            logger.exception("could not answer a client after an internal error")
        except Exception:
            pass
