"""Launch script: `python -m runtime.launch --model smollm2 --port 5557` (console script `radixserve`).

Starts the worker, scheduler and tokenizer processes (subprocesses of this interpreter, each in its own session so a
Ctrl-C reaches only the launcher), waits until each reports ProcessReady, prints the public endpoint, logs the
scheduler's stats every log_interval_s, and shuts everything down on Ctrl-C / SIGTERM. When a child dies it tells the
tokenizer (which answers every request in flight with an error), stops the others and exits with status 1. Children
exit when the launcher dies (PR_SET_PDEATHSIG on Linux, and a parent-pid check on every poll timeout).

Internal links are ipc:// sockets in a private temp dir (ARCHITECTURE.md, "Processes and sockets").
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import typing

import msgspec
import zmq

from runtime import protocol as p
from runtime.config import InvalidConfig, ServerArgs
from runtime.serve.process import POLL_MS, ChildSpec, Endpoints, die_with_parent

logger = logging.getLogger(__name__)

ROLES = ("worker", "scheduler", "tokenizer")


class LaunchError(RuntimeError):
    """A child failed to start or died before the server was ready."""


def child_main(spec_json: str) -> None:
    """Entry point of a child: runs the role's process loop until told to stop or the parent dies."""
    spec = msgspec.json.decode(spec_json, type=ChildSpec)
    logging.basicConfig(level=os.environ.get("RADIXSERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s {spec.role}[%(process)d] %(name)s: %(message)s")
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C and stops us in order
    if spec.role == "worker":
        from runtime.serve.worker_process import run_worker_process as run
    elif spec.role == "scheduler":
        from runtime.serve.scheduler_process import run_scheduler_process as run
    else:
        from runtime.serve.tokenizer_process import run_tokenizer_process as run
    run(spec)


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
    parser = argparse.ArgumentParser(prog="radixserve", description="Serve a model over ZeroMQ with prefix caching.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        flag, default, help_ = "--" + f.name.replace("_", "-"), f.default, f.metadata.get("help", "")
        if hints[f.name] is bool:
            parser.add_argument(flag, dest=f.name, default=default, help=help_, action=argparse.BooleanOptionalAction)
            continue
        tp, choices = _flag_type(hints[f.name])
        parser.add_argument(flag, dest=f.name, default=default, help=help_, type=tp, choices=choices)
    parser.add_argument("--log-level", default="INFO", help="logging level of the launcher and its children")
    return parser


class Launcher:
    """Owns the three children of one server. start() returns the public endpoint once all are ready.

    Raises LaunchError from start() when a child fails to start (its message is included) or dies during start-up.
    """

    def __init__(self, args: ServerArgs, startup_timeout_s: float = 600.0) -> None:
        self.args, self.startup_timeout_s = args, startup_timeout_s
        self.ipc_dir = tempfile.mkdtemp(prefix="radixserve-")
        self.endpoints = Endpoints.under(self.ipc_dir)
        self.ctx = zmq.Context()
        self.reports = self.ctx.socket(zmq.PULL)
        self.reports.bind(self.endpoints.launcher)
        self.procs: dict[str, subprocess.Popen] = {}
        self.endpoint = ""

    def _spawn(self, role: str) -> subprocess.Popen:
        spec = ChildSpec(role, os.getpid(), self.endpoints, self.args)
        cmd = [sys.executable, "-m", "runtime.serve.launch", "--child", msgspec.json.encode(spec).decode()]
        return subprocess.Popen(cmd, start_new_session=True)

    def start(self) -> str:
        """Spawns the children and waits for their ProcessReady; returns the public endpoint (tcp://host:port)."""
        for role in ROLES:
            self.procs[role] = self._spawn(role)
        waiting, deadline = set(ROLES), time.monotonic() + self.startup_timeout_s
        decoder = msgspec.msgpack.Decoder(p.LauncherInput)
        while waiting:
            if time.monotonic() > deadline:
                raise LaunchError(f"{sorted(waiting)} not ready after {self.startup_timeout_s} s")
            dead = self.dead_child()
            if dead:
                raise LaunchError(dead)
            if not self.reports.poll(200):
                continue
            msg = decoder.decode(self.reports.recv())
            if isinstance(msg, p.ProcessFailed):
                raise LaunchError(f"{msg.role} process failed to start: {msg.message}")
            waiting.discard(msg.role)
            self.endpoint = msg.endpoint or self.endpoint
            logger.info("%s process ready (pid %d)", msg.role, msg.pid)
        return self.endpoint

    def dead_child(self) -> str | None:
        """A sentence naming the first child that exited, or None while all run."""
        for role, proc in self.procs.items():
            if proc.poll() is not None:
                return f"{role} process exited with status {proc.returncode}"
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
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def serve_forever(self) -> int:
        """Logs stats every log_interval_s until SIGINT/SIGTERM (returns 0) or a child dies (returns 1)."""
        stop: list[str] = []

        def on_signal(signum: int, _frame: object) -> None:
            stop.append(signal.Signals(signum).name)

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
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
        self.shutdown(f"server stopped ({stop[0]})")
        return 0


def log_stats(s: p.ServerStats) -> None:
    """One log line: running, waiting, tokens/s, KV usage, blocks in the radix tree (evictable of them), hit rate."""
    logger.info("running %d, waiting %d, %.1f tokens/s, KV usage %.1f%%, %d cached blocks (%d evictable), "
                "hit rate %.1f%%", s.num_running, s.num_waiting, s.tokens_per_s, 100 * s.kv_usage,
                s.num_cached_blocks, s.num_evictable_blocks, 100 * s.hit_rate)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: parses ServerArgs flags, serves until Ctrl-C / SIGTERM; exit status 1 when a child died."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child_main(argv[1])
        return 0
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("RADIXSERVE_LOG_LEVEL", ns.log_level)
    try:
        args = ServerArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)})
    except InvalidConfig as exc:
        parser.error(str(exc))  # exits with status 2 and the usage line
    launcher = Launcher(args)
    try:
        endpoint = launcher.start()
    except (LaunchError, KeyboardInterrupt) as exc:
        logger.error("start-up failed: %s", exc)
        launcher.shutdown(f"start-up failed: {exc}", p.ERR_SERVER)
        return 1
    print(f"radixserve ready at {endpoint}", flush=True)
    return launcher.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
