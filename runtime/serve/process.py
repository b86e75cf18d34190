"""What every child process shares with the launcher: its endpoints, its spec, the start-up report, and the checks
that make a child exit when the launcher dies (PR_SET_PDEATHSIG on Linux, and a parent-pid check on every poll).

Endpoints leave nothing on disk that could outlive the server: on Linux they are abstract-namespace ipc names
(`ipc://@radixserve-<random>/<name>`, gone with the last socket, even after `kill -9`); elsewhere they live in a
private temp dir that the launcher removes, or a child once it finds the launcher dead.

The process loops import this module, never the launcher, so launch -> *_process -> process has no circle.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time

import msgspec
import zmq

from runtime import protocol as p
from runtime.config import ServerArgs

logger = logging.getLogger(__name__)

POLL_MS = 500  # every process loop wakes at least this often (milliseconds) to check its parent
IPC_PREFIX = "radixserve-"  # the name (Linux: abstract) or temp dir of one server's ipc endpoints starts with this


def new_ipc_base(prefix: str = IPC_PREFIX) -> str:
    """The base of a new server's ipc endpoints: "@<prefix><16 hex>" on Linux (abstract namespace: no file at all),
    else a new private temp dir (remove it with remove_ipc_base)."""
    if sys.platform.startswith("linux"):
        return f"@{prefix}{secrets.token_hex(8)}"
    return tempfile.mkdtemp(prefix=prefix)


def remove_ipc_base(base: str) -> None:
    """Removes the temp dir of new_ipc_base (nothing to do for an abstract name). Never raises."""
    if not base.startswith("@"):
        shutil.rmtree(base, ignore_errors=True)


class Endpoints(msgspec.Struct, frozen=True):
    """The ipc:// endpoints of one server, all under one base (new_ipc_base). Binder -> connectors:

    launcher: launcher PULL <- every child's PUSH (ProcessReady / ProcessFailed).
    worker_in: worker PULL <- scheduler PUSH (ForwardBatch, WorkerProbe).  worker_out: scheduler PULL <- worker PUSH
    (Ready, ForwardResult, WorkerProbeReply).  scheduler_in: scheduler PULL <- tokenizer PUSH (TokenizedRequest,
    AbortRequest, Stop, control).  tokenizer_in: tokenizer PULL <- scheduler PUSH (TokenOutputs, replies) and launcher
    PUSH (Shutdown).  events: scheduler PUB -> KV events (topic b"kv") and ServerStats (topic b"stats").
    """

    launcher: str
    worker_in: str
    worker_out: str
    scheduler_in: str
    tokenizer_in: str
    events: str

    @classmethod
    def under(cls, base: str) -> Endpoints:
        return cls(**{f: f"ipc://{base}/{f}" for f in cls.__struct_fields__})

    @property
    def base(self) -> str:
        """The base the endpoints were made under (an abstract "@name" or a temp dir)."""
        return self.launcher.removeprefix("ipc://").rsplit("/", 1)[0]


class ChildSpec(msgspec.Struct, frozen=True):
    """What a child process needs, passed as JSON on its command line (no pickle)."""

    role: str
    parent_pid: int
    endpoints: Endpoints
    server_args: ServerArgs


def die_with_parent() -> None:
    """Asks Linux to SIGTERM this process when its parent dies (no-op elsewhere). A parent that died before this call
    sends nothing: the loops' parent_alive check covers that."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        except OSError:
            logger.debug("prctl unavailable; relying on the parent-pid check")


_stop_signals: list[str] = []  # names of the stop signals this process received (stop_on_sigterm)


def stop_on_sigterm() -> None:
    """Makes SIGTERM (the launcher stopping this child, or PR_SET_PDEATHSIG when the launcher dies) end keep_running()
    instead of the process, so its loop can answer its clients before it exits. Call from the main thread."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: _stop_signals.append(signal.Signals(signum).name))


def parent_alive(spec: ChildSpec) -> bool:
    """False once the launcher has died (the child was re-parented)."""
    return os.getppid() == spec.parent_pid


def keep_running(spec: ChildSpec) -> bool:
    """False once the launcher has died or this process got SIGTERM (after stop_on_sigterm)."""
    return not _stop_signals and parent_alive(spec)


PDEATH_GRACE_S = 0.25  # how long a SIGTERM waits to be told apart from the launcher's death (stop_message)


def stop_message(spec: ChildSpec) -> p.Shutdown:
    """Why keep_running() turned False, as the Shutdown the tokenizer answers clients with: ERR_SERVER "the launcher
    died", or ERR_SHUTDOWN when only this process was stopped.

    A SIGTERM can be PR_SET_PDEATHSIG's: Linux sends it when the launcher's thread that started this child exits,
    which under `kill -9` can come before the launcher's last thread is gone (getppid still names it). So after a
    signal, a parent that is still there is given up to PDEATH_GRACE_S seconds to go before the stop counts as this
    process's own."""
    if _stop_signals:
        deadline = time.monotonic() + PDEATH_GRACE_S
        while parent_alive(spec) and time.monotonic() < deadline:
            time.sleep(0.01)
    if not parent_alive(spec):
        return p.Shutdown("the launcher died", p.ERR_SERVER)
    return p.Shutdown(f"the {spec.role} process was stopped ({', '.join(_stop_signals) or 'no signal'})")


def one_line(exc: BaseException) -> str:
    """ "<ExceptionType>: <message>" on one line (newlines and runs of spaces become one space): the cause of a failed
    start, as ProcessFailed carries it to the launcher's one log line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def bind(sock: zmq.Socket, endpoint: str, what: str) -> None:
    """sock.bind(endpoint); raises StartupError("cannot bind <what> <endpoint>: <reason>") when it fails."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise StartupError(f"cannot bind {what} {endpoint}: {zmq_reason(exc)}") from None


def zmq_reason(exc: zmq.ZMQError) -> str:
    """The OS's words for a ZMQError ("Address already in use"), without the endpoint pyzmq appends to strerror."""
    return os.strerror(exc.errno) if exc.errno else str(exc)


class StartupError(RuntimeError):
    """A child cannot start; the message is the one-line cause the launcher reports (no exception type prefix)."""


def report(sock: zmq.Socket, msg: p.ProcessReady | p.ProcessFailed) -> None:
    """Sends a start-up report to the launcher."""
    sock.send(msgspec.msgpack.encode(msg))


def report_failure(ctx: zmq.Context, reports: zmq.Socket, role: str, exc: BaseException) -> None:
    """Logs and reports why this child cannot start (ProcessFailed with one line: a StartupError's message, else
    one_line(exc)), then destroys ctx once the report is delivered (2 s at most), so the launcher reads the cause
    before it sees the process exit. The traceback goes to the DEBUG log."""
    message = str(exc) if isinstance(exc, StartupError) else one_line(exc)
    logger.error("cannot start: %s", message)
    logger.debug("start-up failure", exc_info=exc)
    report(reports, p.ProcessFailed(role, os.getpid(), message))
    ctx.destroy(linger=2000)
