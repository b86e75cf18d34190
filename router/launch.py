"""Launch script of the router: `python -m router.launch --model smollm2 --replicas 2 [--policy cache_aware]` starts
two local runtime replicas (runtime.serve.launch.Launcher, each on a free port with its KV events on TCP) and the router
process in front of them; `python -m router.launch --model smollm2 --backends tcp://HOST_A:5557,tcp://HOST_B:5557`
starts only the router (the replicas run elsewhere with `--events-port`). Every ServerArgs flag is accepted: --host and
--port are the router's public endpoint, --http-port (with --api-key, --served-model-name) puts the OpenAI-compatible
HTTP server in front of it (runtime/serve/http/process.py, on --host), the others configure the local replicas.

The router runs in its own process (`python -m router.launch --child <json>`), so a client in this process (a
benchmark) does not share its interpreter. It reports ProcessReady once every backend is in rotation. A local replica
that dies is shut down and started again on the same port; the router takes it back with a fresh snapshot.
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

import msgspec
import zmq

from router.config import RouterArgs
from router.policy import POLICIES
from runtime import protocol as p
from runtime.config import ServerArgs
from runtime.serve.http.process import http_child_env
from runtime.serve.launch import HTTP_EXIT_GRACE_S, Launcher, LaunchError, build_parser
from runtime.serve.process import ChildSpec, Endpoints, die_with_parent, new_ipc_base, remove_ipc_base

logger = logging.getLogger(__name__)

POLL_MS = 500


class RouterSpec(msgspec.Struct, frozen=True):
    """What the router process needs, as JSON on its command line (no pickle)."""

    parent_pid: int
    launcher: str  # ipc:// endpoint of the launcher's PULL (ProcessReady)
    args: RouterArgs


class RouterLauncher:
    """Starts `replicas` local replicas of server_args (none when backends are given) and the router process.

    Use as a context manager or call start() / shutdown(). start() returns the router's public endpoint
    (tcp://host:port) once every backend is in rotation, after starting the HTTP server in front of it when
    server_args.http_port is set (http_url: "http://HOST:PORT", else ""; the replicas serve no HTTP of their own).
    router_kwargs: RouterArgs fields (policy, load_metric, balance_threshold, health_interval_s, ...). Raises
    LaunchError when a replica, the router or the HTTP server fails to start.
    """

    def __init__(
        self,
        server_args: ServerArgs | None = None,
        replicas: int = 0,
        backends: list[str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        startup_timeout_s: float = 600.0,
        **router_kwargs,
    ) -> None:
        if replicas < 1 and not backends:
            raise ValueError("give replicas >= 1 (local) or backends (endpoints of running replicas)")
        self.server_args = server_args or ServerArgs()
        self.num_replicas = replicas
        self.backends = list(backends or [])
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.router_kwargs = router_kwargs
        self.replicas: list[Launcher] = []
        self.router_proc: subprocess.Popen | None = None
        self.http_proc: subprocess.Popen | None = None
        self.http_url = ""
        self.ipc_base = new_ipc_base("radixserve-router-")  # Linux: an abstract name, nothing on disk
        self.ctx = zmq.Context()
        self.endpoint = ""

    def __enter__(self) -> RouterLauncher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown("router launcher exited")

    def _replica_args(self, port: int = 0, rank: int = 0) -> ServerArgs:
        """Replica ``rank``'s ServerArgs: on 127.0.0.1, its KV events on TCP, no HTTP; data-parallel rank ``rank`` of
        the replicas (its vLLM-format KV events' rank and port offset, runtime/serve/vllm_events)."""
        return dataclasses.replace(
            self.server_args,
            host="127.0.0.1",
            port=port,
            events_port=0,
            http_port=None,
            data_parallel_size=max(self.num_replicas, 1),
            data_parallel_rank=rank,
        )

    def _start_replica(self, port: int = 0, rank: int = 0) -> Launcher:
        launcher = Launcher(self._replica_args(port, rank), self.startup_timeout_s)
        try:
            launcher.start()
        except LaunchError:
            launcher.shutdown("start-up failed", p.ERR_SERVER)
            raise
        return launcher

    def start(self) -> str:
        """Starts the replicas, the router and (server_args.http_port set) the HTTP server in front of it; returns
        the router's endpoint."""
        if self.num_replicas and not self.backends:
            # One after the other, from this thread: Linux sends PR_SET_PDEATHSIG when the *thread* that spawned a
            # child exits, so replicas started from a worker thread would be killed when the pool ends.
            for rank in range(self.num_replicas):
                try:
                    self.replicas.append(self._start_replica(rank=rank))
                except LaunchError as exc:
                    self.shutdown("a replica failed to start", p.ERR_SERVER)
                    raise LaunchError(f"replica failed to start: {exc}") from exc
            self.backends = [r.endpoint for r in self.replicas]
        args = RouterArgs(
            backends=self.backends,
            model=self.server_args.model,
            host=self.host,
            port=self.port,
            max_message_bytes=self.server_args.max_message_bytes,
            **self.router_kwargs,
        )
        pull = self.ctx.socket(zmq.PULL)
        endpoints = Endpoints.under(self.ipc_base)
        pull.bind(endpoints.launcher)
        try:
            spec = RouterSpec(os.getpid(), endpoints.launcher, args)
            cmd = [sys.executable, "-m", "router.launch", "--child", msgspec.json.encode(spec).decode()]
            self.router_proc = subprocess.Popen(cmd, start_new_session=True)
            self.endpoint = self._wait_ready(pull, self.router_proc, "router")
            if self.server_args.http_port is not None:
                self.http_url = self._start_http(pull, endpoints)
        finally:
            pull.close(linger=0)
        return self.endpoint

    def _start_http(self, pull: zmq.Socket, endpoints: Endpoints) -> str:
        """Starts the HTTP server in front of the router (runtime/serve/http/process.py; the API key in its
        environment, never on its command line) and returns its URL once it is ready."""
        port = int(self.endpoint.rsplit(":", 1)[1])
        args = dataclasses.replace(self.server_args, host=self.host, port=port, api_key=None)
        spec = ChildSpec("http", os.getpid(), endpoints, args)
        cmd = [sys.executable, "-m", "runtime.serve.launch", "--child", msgspec.json.encode(spec).decode()]
        self.http_proc = subprocess.Popen(cmd, start_new_session=True, env=http_child_env(self.server_args.api_key))
        return self._wait_ready(pull, self.http_proc, "http")

    def _wait_ready(self, pull: zmq.Socket, proc: subprocess.Popen, role: str) -> str:
        """The endpoint of proc's ProcessReady read from pull. Raises LaunchError when it reports ProcessFailed,
        exits, or is not ready within startup_timeout_s."""
        decoder = msgspec.msgpack.Decoder(p.LauncherInput)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if pull.poll(200):
                msg = decoder.decode(pull.recv())
                if isinstance(msg, p.ProcessFailed):
                    raise LaunchError(f"{role} failed to start: {msg.message}")
                logger.info("%s ready at %s (pid %d)", role, msg.endpoint, msg.pid)
                return msg.endpoint
            if proc.poll() is not None:
                raise LaunchError(f"{role} process exited with status {proc.returncode}")
        raise LaunchError(f"{role} not ready after {self.startup_timeout_s} s")

    def restart_dead_replicas(self) -> list[int]:
        """Shuts down each local replica with a dead process and starts it again on the same port; returns their
        positions. Raises LaunchError when one cannot be started again."""
        restarted = []
        for i, launcher in enumerate(self.replicas):
            dead = launcher.dead_child()
            if dead is None:
                continue
            logger.warning("replica %d: %s; restarting it", i, dead)
            launcher.shutdown(f"replica failure: {dead}", p.ERR_SERVER)
            port = int(launcher.endpoint.rsplit(":", 1)[1])
            self.replicas[i] = self._start_replica(port, i)
            restarted.append(i)
        return restarted

    def shutdown(self, reason: str, code: str = p.ERR_SHUTDOWN, grace_s: float = 3.0) -> None:
        """Stops the HTTP server and the router (SIGTERM, then SIGKILL after grace_s), then every local replica. Safe
        to call twice."""
        for proc in (self.http_proc, self.router_proc):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for launcher in self.replicas:
            launcher.shutdown(reason, code, grace_s)
        if not self.ctx.closed:
            self.ctx.destroy(linger=0)
        remove_ipc_base(self.ipc_base)

    def serve_forever(self, ready_line: str | None = None) -> int:
        """Until SIGINT / SIGTERM (returns 0) or the router or the HTTP server dies (returns 1); restarts local
        replicas that die. ready_line is printed once the signal handlers are in place."""
        stop: list[str] = []
        signal.signal(signal.SIGINT, lambda signum, _frame: stop.append(signal.Signals(signum).name))
        signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signal.Signals(signum).name))
        if ready_line is not None:
            print(ready_line, flush=True)
        while not stop:
            for role, proc in (("router", self.router_proc), ("http", self.http_proc)):
                if proc is not None and proc.poll() is not None:
                    logger.error("%s process exited with status %d", role, proc.returncode)
                    self.shutdown(f"{role} failure", p.ERR_SERVER)
                    return 1
            try:
                self.restart_dead_replicas()
            except LaunchError as exc:
                logger.error("%s", exc)
            time.sleep(POLL_MS / 1000)
        logger.info("%s received; shutting down", stop[0])
        if stop[0] == "SIGTERM" and self.http_proc is not None and self.http_proc.poll() is None:
            self.http_proc.terminate()  # the HTTP server drains: runtime.serve.http.drain
            try:
                self.http_proc.wait(self.server_args.shutdown_timeout + HTTP_EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                logger.warning("the http process did not finish draining in time")
        self.shutdown(f"router stopped ({stop[0]})")
        return 0


def run_router_process(spec_json: str) -> None:
    """Router process entry: loads the tokenizer, binds the endpoint, reports ProcessReady once every backend is in
    rotation, serves until SIGTERM or the launcher dies."""
    from router.router import Router
    from runtime.model.loader import load_tokenizer

    spec = msgspec.json.decode(spec_json, type=RouterSpec)
    logging.basicConfig(
        level=os.environ.get("RADIXSERVE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s router[%(process)d] %(name)s: %(message)s",
    )
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))
    ctx = zmq.Context()
    reports = ctx.socket(zmq.PUSH)
    reports.connect(spec.launcher)
    try:
        router = Router(spec.args, load_tokenizer(spec.args.model), ctx)
        endpoint = router.bind()
    except Exception as exc:
        logger.exception("router failed to start")
        reports.send(msgspec.msgpack.encode(p.ProcessFailed("router", os.getpid(), f"{type(exc).__name__}: {exc}")))
        reports.close(linger=2000)
        return

    def on_ready() -> None:
        reports.send(msgspec.msgpack.encode(p.ProcessReady("router", os.getpid(), endpoint)))
        logger.info("routing on %s to %s (policy %s)", endpoint, spec.args.backends, spec.args.policy)

    router.serve(lambda: not stop and os.getppid() == spec.parent_pid, on_ready)
    logger.info("router stopping; routed %s", router.stats)
    router.close()
    reports.close(linger=0)
    ctx.term()
    if os.getppid() != spec.parent_pid:  # off Linux: the launcher died and left its ipc temp dir
        remove_ipc_base(spec.launcher.removeprefix("ipc://").rsplit("/", 1)[0])


def build_router_parser() -> argparse.ArgumentParser:
    """The ServerArgs flags (runtime.serve.launch.build_parser) plus the router's."""
    parser = build_parser()
    parser.prog = "python -m router.launch"
    parser.description = "Route requests across runtime replicas by resident prefix (KV events)."
    defaults = RouterArgs(backends=["tcp://127.0.0.1:1"])
    parser.add_argument("--replicas", type=int, default=0, help="local replicas to start (unless --backends)")
    parser.add_argument("--backends", default="", help="comma-separated tcp:// endpoints of running replicas")
    parser.add_argument("--policy", default=defaults.policy, choices=list(POLICIES))
    parser.add_argument("--load-metric", default=defaults.load_metric, choices=["requests", "tokens"])
    for name in ("balance_threshold", "health_interval_s", "health_timeout_s", "pending_timeout_s"):
        value = getattr(defaults, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    return parser


def main(argv: list[str] | None = None, ready_prefix: str = "radixserve router ready at") -> int:
    """CLI entry: starts replicas (--replicas, or --data-parallel-size: the larger; none with --backends) and the
    router; prints "<ready_prefix> <endpoint>" once it serves, until Ctrl-C / SIGTERM. runtime.launch.main calls
    it for `radixserve --data-parallel-size N` (N > 1) with the server's own ready line."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        run_router_process(argv[1])
        return 0
    ns = build_router_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("RADIXSERVE_LOG_LEVEL", ns.log_level)
    server_args = ServerArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)})
    backends = [b.strip() for b in ns.backends.split(",") if b.strip()]
    replicas = 0 if backends else max(ns.replicas, ns.data_parallel_size)
    launcher = RouterLauncher(
        server_args,
        replicas,
        backends,
        ns.host,
        ns.port,
        policy=ns.policy,
        load_metric=ns.load_metric,
        balance_threshold=ns.balance_threshold,
        health_interval_s=ns.health_interval_s,
        health_timeout_s=ns.health_timeout_s,
        pending_timeout_s=ns.pending_timeout_s,
    )
    try:
        endpoint = launcher.start()
    except (LaunchError, KeyboardInterrupt) as exc:
        logger.error("start-up failed: %s", exc)
        launcher.shutdown(f"start-up failed: {exc}", p.ERR_SERVER)
        return 1
    # the http child printed its ready line before
    return launcher.serve_forever(f"{ready_prefix} {endpoint}")


if __name__ == "__main__":
    sys.exit(main())
