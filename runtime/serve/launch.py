"""Launch script: `python -m runtime.launch --model smollm2 --port 5557` (console script `radixserve`).

Starts the worker, scheduler and tokenizer processes (subprocesses of this interpreter, each in its own session so a
Ctrl-C reaches only the launcher), waits until each reports ProcessReady, then, with `--http-port PORT`, the
OpenAI-compatible HTTP server (a 4th child, role "http", runtime/serve/http/process.py: a client of the public
endpoint, bound to --host:PORT, the API key of --api-key or RADIXSERVE_API_KEY passed in its environment, never on a
command line; it prints "radixserve http ready at http://HOST:PORT" itself); prints the public endpoint, logs the
scheduler's stats every log_interval_s, and shuts everything down on Ctrl-C (at once) / SIGTERM (after a drain of
at most --shutdown-timeout seconds: Launcher.drain; the exit status is 0). When a child dies it tells the
tokenizer (which answers every request in flight with an error), stops the others and exits with status 1. Children
exit when the launcher dies (PR_SET_PDEATHSIG on Linux, and a parent-pid check on every poll timeout); the tokenizer
first answers every request in flight with ErrorResponse(ERR_SERVER, "the launcher died").

A start-up failure ends in one line naming its cause, e.g. "start-up failed: scheduler process failed to start: cannot
bind events_port tcp://127.0.0.1:5599: Address already in use": each child reports why it cannot start
(ProcessFailed), and a child that exits without a word is named with its exit status.

Internal links are ipc:// sockets under runtime.serve.process.new_ipc_base: abstract names on Linux, so nothing is
left on disk even after `kill -9` of the launcher (docs/ARCHITECTURE.md, "Processes and sockets").
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
import typing

import msgspec
import zmq

from runtime import protocol as p
from runtime.client import Client, ClientError
from runtime.config import InvalidConfig, ServerArgs
from runtime.serve.http.process import http_child_env
from runtime.serve.process import (
    POLL_MS,
    ChildSpec,
    Endpoints,
    die_with_parent,
    new_ipc_base,
    one_line,
    parent_alive,
    remove_ipc_base,
    stop_on_sigterm,
    zmq_reason,
)
from runtime.serve.worker_rank import RANK_ROLE, free_port, worker_roles

logger = logging.getLogger(__name__)

ROLES = ("worker", "scheduler", "tokenizer")
HTTP_EXIT_GRACE_S = 7.0  # beyond shutdown_timeout: the http child's own stop (uvicorn's graceful 5 s) and exit
IDLE_POLL_S = 0.1  # drain: between stats requests while the backend finishes its ZeroMQ clients' requests
REPORT_WAIT_S = 0.25  # how long a dead child's ProcessFailed may trail its exit (it is sent before the child exits)


class LaunchError(RuntimeError):
    """A child failed to start or died before the server was ready."""


def child_main(spec_json: str) -> int:
    """Entry point of a child: runs the role's process loop until told to stop or the parent dies. Returns the exit
    status: 0, or 1 when the loop raised (reported to the launcher as ProcessFailed with the cause on one line).

    The worker and the scheduler die at once on PR_SET_PDEATHSIG's SIGTERM (even in the middle of a step); the
    tokenizer handles it (stop_on_sigterm) to answer its clients first. Off Linux, a child that finds the launcher
    dead removes the ipc temp dir the launcher could not."""
    spec = msgspec.json.decode(spec_json, type=ChildSpec)
    logging.basicConfig(
        level=os.environ.get("RADIXSERVE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s {spec.role}[%(process)d] %(name)s: %(message)s",
    )
    if spec.role == "tokenizer":
        stop_on_sigterm()
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C and stops us in order
    try:
        if spec.role == "worker":
            from runtime.serve.worker_process import run_worker_process as run
        elif spec.role.startswith(RANK_ROLE):
            from runtime.serve.worker_rank import run_worker_rank as run
        elif spec.role == "scheduler":
            from runtime.serve.scheduler_process import run_scheduler_process as run
        elif spec.role == "http":
            from runtime.serve.http.process import run_http_process as run
        else:
            from runtime.serve.tokenizer.process import run_tokenizer_process as run
        run(spec)
    except Exception as exc:
        logger.exception("%s process failed", spec.role)
        _report_crash(spec, exc)
        return 1
    finally:
        if not parent_alive(spec):
            remove_ipc_base(spec.endpoints.base)
    return 0


def _report_crash(spec: ChildSpec, exc: BaseException) -> None:
    """Tells the launcher why this child is about to exit (ProcessFailed, one line); waits 2 s at most."""
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(spec.endpoints.launcher)
    push.send(msgspec.msgpack.encode(p.ProcessFailed(spec.role, os.getpid(), one_line(exc))))
    ctx.destroy(linger=2000)


def _flag_type(tp: typing.Any) -> tuple[typing.Any, list | None]:
    """(argparse type, choices) for a ServerArgs field type."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Literal:
        return type(args[0]), list(args)
    if args:  # X | None
        return _flag_type(args[0])
    return tp, None


def build_parser() -> argparse.ArgumentParser:
    """argparse parser with one flag per ServerArgs field (generated, so new fields get flags automatically)."""
    parser = argparse.ArgumentParser(
        prog="radixserve",
        description="Serve a model over ZeroMQ with prefix caching.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    hints = typing.get_type_hints(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        flag, default, help_ = "--" + f.name.replace("_", "-"), f.default, f.metadata.get("help", "")
        if hints[f.name] is bool:
            parser.add_argument(flag, dest=f.name, default=default, help=help_, action=argparse.BooleanOptionalAction)
            continue
        tp, choices = _flag_type(hints[f.name])
        flags = [flag, f.metadata["alias"]] if "alias" in f.metadata else [flag]
        parser.add_argument(*flags, dest=f.name, default=default, help=help_, type=tp, choices=choices)
    parser.add_argument("--log-level", default="INFO", help="logging level of the launcher and its children")
    return parser


class Launcher:
    """Owns the children of one server: worker, scheduler, tokenizer, and the HTTP server when args.http_port is set.
    start() returns the public endpoint once all are ready; http_url is then "http://HOST:PORT" ("" without HTTP).

    Raises LaunchError from the constructor when the launcher's own socket cannot be bound, and from start() when a
    child fails to start (its one-line cause is included) or dies during start-up (its exit status).
    """

    def __init__(self, args: ServerArgs, startup_timeout_s: float = 600.0) -> None:
        if args.tensor_parallel_size > 1 and args.master_port is None:  # a single node: the ranks' store port
            args = dataclasses.replace(args, master_port=free_port(args.master_addr))
        self.args = args
        self.startup_timeout_s = startup_timeout_s
        self.ipc_base = new_ipc_base()
        self.endpoints = Endpoints.under(self.ipc_base)
        self.ctx = zmq.Context()
        self.reports = self.ctx.socket(zmq.PULL)
        self.procs: dict[str, subprocess.Popen] = {}
        self.endpoint = ""
        self.http_url = ""
        self.max_model_len: int | None = None  # the scheduler's ProcessReady says it (the model's, or the flag's)
        self._decoder = msgspec.msgpack.Decoder(p.LauncherInput)
        try:
            self.reports.bind(self.endpoints.launcher)
        except zmq.ZMQError as exc:
            self.ctx.destroy(linger=0)
            remove_ipc_base(self.ipc_base)
            reason = zmq_reason(exc)
            raise LaunchError(f"cannot bind the launcher's socket {self.endpoints.launcher}: {reason}") from None

    def _spawn(self, role: str) -> subprocess.Popen:
        """Starts one child. The API key is left out of every ChildSpec (a command line is visible to all users):
        the http child gets it as RADIXSERVE_API_KEY in its environment, with the public endpoint's bound port and the
        max_model_len the scheduler reported (for its model cards)."""
        args, env = dataclasses.replace(self.args, api_key=None), None
        if role == "http":
            port = int(self.endpoint.rsplit(":", 1)[1])
            args = dataclasses.replace(args, port=port, max_model_len=self.max_model_len or args.max_model_len)
            env = http_child_env(self.args.api_key)
        spec = ChildSpec(role, os.getpid(), self.endpoints, args)
        cmd = [sys.executable, "-m", "runtime.serve.launch", "--child", msgspec.json.encode(spec).decode()]
        try:
            return subprocess.Popen(cmd, start_new_session=True, env=env)
        except OSError as exc:
            raise LaunchError(f"cannot start the {role} process: {one_line(exc)}") from None

    def start(self) -> str:
        """Spawns the children and waits for their ProcessReady (the HTTP server's once the tokenizer is ready);
        returns the public endpoint (tcp://host:port)."""
        deadline = time.monotonic() + self.startup_timeout_s
        roles = worker_roles(self.args) + (list(ROLES[1:]) if self.args.node_rank == 0 else [])
        for role in roles:
            self.procs[role] = self._spawn(role)
        self._wait_ready(set(roles), deadline)
        if self.args.http_port is not None:
            self.procs["http"] = self._spawn("http")
            self._wait_ready({"http"}, deadline)
        return self.endpoint

    def _wait_ready(self, waiting: set[str], deadline: float) -> None:
        """Reads start-up reports until every role of waiting reported ProcessReady (it records the tokenizer's
        endpoint and the http child's URL). Raises LaunchError when one failed, died or the deadline passed."""
        while waiting:
            if time.monotonic() > deadline:
                raise LaunchError(f"{sorted(waiting)} not ready after {self.startup_timeout_s} s")
            if self.reports.poll(200):
                msg = self._decoder.decode(self.reports.recv())
                if isinstance(msg, p.ProcessFailed):
                    raise LaunchError(f"{msg.role} process failed to start: {msg.message}")
                waiting.discard(msg.role)
                if msg.role == "http":
                    self.http_url = msg.endpoint
                else:
                    self.endpoint = msg.endpoint or self.endpoint
                self.max_model_len = msg.max_model_len or self.max_model_len
                logger.info("%s process ready (pid %d)", msg.role, msg.pid)
                continue
            dead = self.dead_child()
            if dead:
                raise LaunchError(dead)

    def dead_child(self) -> str | None:
        """A sentence naming the first child that exited and why: "<role> process failed to start: <cause>" when it
        reported ProcessFailed (waits up to REPORT_WAIT_S for it), else "<role> process exited with status N";
        None while all run."""
        for role, proc in self.procs.items():
            if proc.poll() is not None:
                failure = self._failure_report(role)
                if failure is not None:
                    return failure
                return f"{role} process exited with status {proc.returncode}"
        return None

    def _failure_report(self, role: str) -> str | None:
        """The cause a child that exited reported (ProcessFailed), read from the launcher's socket; None if none came
        within REPORT_WAIT_S. Other reports read meanwhile are dropped (the server is going down)."""
        deadline = time.monotonic() + REPORT_WAIT_S
        while not self.ctx.closed and self.reports.poll(max(0, int(1000 * (deadline - time.monotonic())))):
            msg = self._decoder.decode(self.reports.recv())
            if isinstance(msg, p.ProcessFailed) and msg.role == role:
                verb = "failed" if self.endpoint else "failed to start"
                return f"{role} process {verb}: {msg.message}"
        return None

    def shutdown(self, reason: str, code: str = p.ERR_SHUTDOWN, grace_s: float = 3.0) -> None:
        """Tells the tokenizer (it errors every request in flight), then stops every child: SIGTERM, then SIGKILL
        after grace_s seconds. Removes the ipc dir. Safe to call twice."""
        if self.ctx.closed:
            return
        tok = self.procs.get("tokenizer")
        if tok is not None and tok.poll() is None:
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 500)
            push.connect(self.endpoints.tokenizer_in)
            push.send(msgspec.msgpack.encode(p.Shutdown(reason, code)))
            push.close()
            try:
                tok.wait(grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("tokenizer did not exit after Shutdown")
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.ctx.destroy(linger=0)  # closes every socket of this launcher, then terminates the context
        remove_ipc_base(self.ipc_base)

    def serve_forever(self, ready_line: str | None = None) -> int:
        """Logs stats every log_interval_s until SIGINT/SIGTERM (returns 0) or a child dies (returns 1). ready_line
        is printed (flushed) once the signal handlers are in place, so a Ctrl-C sent as soon as it is read stops the
        server in order instead of raising KeyboardInterrupt."""
        stop: list[str] = []

        def on_signal(signum: int, _frame: object) -> None:
            stop.append(signal.Signals(signum).name)

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        if ready_line is not None:
            print(ready_line, flush=True)
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"stats")
        sub.connect(self.endpoints.events)
        stats_decoder = msgspec.msgpack.Decoder(p.ServerStats)
        try:
            while not stop:
                dead = self.dead_child()
                if dead:
                    logger.error("%s; shutting down", dead)
                    self.shutdown(f"server failure: {dead}", p.ERR_SERVER)
                    return 1
                if sub.poll(POLL_MS):
                    _topic, payload = sub.recv_multipart()
                    log_stats(stats_decoder.decode(payload))
        finally:
            sub.close(linger=0)
        logger.info("%s received; shutting down", stop[0])
        if stop[0] == "SIGTERM":
            self.drain()
        self.shutdown(f"server stopped ({stop[0]})")
        return 0

    def drain(self) -> None:
        """The graceful part of a SIGTERM, within args.shutdown_timeout seconds: the HTTP child is sent SIGTERM (it
        answers new requests 503 and exits once its requests in flight finished: runtime.serve.http.drain) and
        waited for; then the backend is given the rest of the time to finish what its ZeroMQ clients have running
        or waiting (new ZeroMQ requests are still admitted meanwhile). shutdown() follows."""
        deadline = time.monotonic() + self.args.shutdown_timeout
        http = self.procs.get("http")
        if http is not None and http.poll() is None:
            http.terminate()
            try:
                http.wait(self.args.shutdown_timeout + HTTP_EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                logger.warning("the http process did not finish draining in time")
        wait_backend_idle(self.endpoint, deadline)


def wait_backend_idle(endpoint: str, deadline: float) -> None:
    """Returns once the server at endpoint runs, waits for and holds swapped no sequence, or at deadline
    (time.monotonic() seconds), polling its stats every IDLE_POLL_S; at once when it does not answer."""
    with Client(endpoint, timeout=IDLE_POLL_S * 20) as client:
        while time.monotonic() < deadline:
            try:
                s = client.stats()
            except ClientError as exc:
                logger.warning("drain: the server's stats are not available (%s)", exc)
                return
            if s.num_running + s.num_waiting + s.num_swapped == 0:
                return
            time.sleep(IDLE_POLL_S)
    logger.warning("drain: the shutdown timeout passed with requests still running")


def log_stats(s: p.ServerStats) -> None:
    """One log line: running, waiting, tokens/s, KV usage, blocks in the radix tree (evictable of them), hit rate."""
    logger.info(
        "running %d, waiting %d, %.1f tokens/s, KV usage %.1f%%, %d cached blocks (%d evictable), hit rate %.1f%%",
        s.num_running,
        s.num_waiting,
        s.tokens_per_s,
        100 * s.kv_usage,
        s.num_cached_blocks,
        s.num_evictable_blocks,
        100 * s.hit_rate,
    )


def main(argv: list[str] | None = None) -> int:
    """CLI entry: parses ServerArgs flags, serves until Ctrl-C / SIGTERM; exit status 1 when a child died."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1])
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("RADIXSERVE_LOG_LEVEL", ns.log_level)
    try:
        args = ServerArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)})
    except InvalidConfig as exc:
        parser.error(str(exc))  # exits with status 2 and the usage line
    if args.data_parallel_size > 1:
        parser.error("--data-parallel-size > 1 is served by `radixserve` (python -m runtime.launch)")
    launcher = None
    try:
        launcher = Launcher(args)
        endpoint = launcher.start()
    except (Exception, KeyboardInterrupt) as exc:
        cause = str(exc) if isinstance(exc, LaunchError) else one_line(exc)
        logger.error("start-up failed: %s", cause)
        if launcher is not None:
            launcher.shutdown(f"start-up failed: {cause}", p.ERR_SERVER)
        return 1
    # after the http child's own "radixserve http ready at" line
    ready = f"radixserve ready at {endpoint}" if endpoint else f"radixserve node {args.node_rank}: worker ranks ready"
    return launcher.serve_forever(ready)


if __name__ == "__main__":
    sys.exit(main())
