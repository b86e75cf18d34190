"""What every child process shares with the launcher: its endpoints, its spec, the start-up report, and the checks
that make a child exit when the launcher dies (PR_SET_PDEATHSIG on Linux, and a parent-pid check on every poll).

The process loops import this module, never the launcher, so launch -> *_process -> process has no circle.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

import msgspec
import zmq

from runtime import protocol as p
from runtime.config import ServerArgs

logger = logging.getLogger(__name__)

POLL_MS = 500  # every process loop wakes at least this often (milliseconds) to check its parent


class Endpoints(msgspec.Struct, frozen=True):
    """The ipc:// endpoints of one server, all under a private temp dir. Binder -> connectors:

    launcher: launcher PULL <- every child's PUSH (ProcessReady / ProcessFailed).
    worker_in: worker PULL <- scheduler PUSH (ForwardBatch).  worker_out: scheduler PULL <- worker PUSH (Ready,
    ForwardResult).  scheduler_in: scheduler PULL <- tokenizer PUSH (TokenizedRequest, AbortRequest, Stop, control).
    tokenizer_in: tokenizer PULL <- scheduler PUSH (TokenOutputs, replies) and launcher PUSH (Shutdown).
    events: scheduler PUB -> KV events (topic b"kv") and ServerStats (topic b"stats").
    """

    launcher: str
    worker_in: str
    worker_out: str
    scheduler_in: str
    tokenizer_in: str
    events: str

    @classmethod
    def under(cls, ipc_dir: str) -> Endpoints:
        return cls(**{f: f"ipc://{ipc_dir}/{f}" for f in cls.__struct_fields__})


class ChildSpec(msgspec.Struct, frozen=True):
    """What a child process needs, passed as JSON on its command line (no pickle)."""

    role: str
    parent_pid: int
    endpoints: Endpoints
    server_args: ServerArgs


def die_with_parent() -> None:
    """Asks Linux to SIGTERM this process when its parent dies (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        except OSError:
            logger.debug("prctl unavailable; relying on the parent-pid check")


def parent_alive(spec: ChildSpec) -> bool:
    """False once the launcher has died (the child was re-parented)."""
    return os.getppid() == spec.parent_pid


def report(sock: zmq.Socket, msg: p.ProcessReady | p.ProcessFailed) -> None:
    """Sends a start-up report to the launcher."""
    sock.send(msgspec.msgpack.encode(msg))


