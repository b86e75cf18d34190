"""Helpers of the router tests: replica and router subprocesses, which replica served a request, a KV snapshot,
and a multi-turn conversation driven through any endpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from runtime import protocol as p
from runtime.client import Client
from tests.paths import ROOT

REPLICA_FLAGS = [
    "--num-blocks",
    "512",
    "--block-size",
    "16",
    "--max-prefill-tokens",
    "512",
    "--events-port",
    "0",
    "--log-interval-s",
    "3600",
    "--dtype",
    "float32",
]
ROUTER_FLAGS = ["--health-interval-s", "0.2", "--health-timeout-s", "1.5"]
BLOCK = 16


@dataclass
class Proc:
    """A launcher (replica or router) subprocess and its public endpoint."""

    proc: subprocess.Popen
    endpoint: str

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def client(self, timeout: float = 60.0) -> Client:
        return Client(self.endpoint, timeout=timeout)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(module: str, args: list[str], log: Path, ready_prefix: str, timeout: float = 120.0) -> Proc:
    """Runs `python -m <module> <args>` and waits for its ready line on stdout."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RADIXSERVE_LOG_LEVEL": "WARNING"}
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(ready_prefix):
            return Proc(proc, line.split()[-1])
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{module} did not start; log:\n{log.read_text()[-4000:]}")


def start_replica(model: Path, log: Path, port: int = 0) -> Proc:
    """A runtime server of `model` on 127.0.0.1:<port> (0: free) with KV events on TCP."""
    return start(
        "runtime.launch", ["--model", str(model), "--port", str(port), *REPLICA_FLAGS], log, "radixserve ready at "
    )


def start_router(model: Path, backends: list[str], log: Path, *flags: str) -> Proc:
    """`python -m router.launch --backends ...` in front of running replicas."""
    return start(
        "router.launch",
        [
            "--model",
            str(model),
            "--port",
            "0",
            "--backends",
            ",".join(backends),
            "--log-level",
            "WARNING",
            *ROUTER_FLAGS,
            *flags,
        ],
        log,
        "radixserve router ready at ",
    )


def served_by(replicas: list[Proc], before: list[int]) -> int:
    """Which replica's prompt_tokens grew since `before` (exactly one must have); returns its position."""
    after = prompt_tokens(replicas)
    grown = [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a != b]
    assert len(grown) == 1, f"prompt tokens before {before}, after {after}"
    return grown[0]


def prompt_tokens(replicas: list[Proc]) -> list[int]:
    """Each replica's prompt_tokens total (its own ServerStats)."""
    out = []
    for r in replicas:
        with r.client() as c:
            out.append(c.stats().prompt_tokens)
    return out


def kv_snapshot(endpoint: str) -> p.KvSnapshotResponse:
    """A replica's KvSnapshotResponse, asked at its public endpoint."""
    with Client(endpoint, timeout=30) as c:
        return c._control(p.KvSnapshotRequest)


def conversation(
    endpoint: str, system: str, users: list[str], salt: str, replicas: list[Proc] | None = None, max_tokens: int = 8
) -> tuple[list[int], list[int | None], list[str]]:
    """Runs a greedy chat conversation turn by turn through endpoint (each turn's request holds the whole history).
    Returns (cached_tokens per turn, the position of the replica that served each turn (None without replicas),
    reply texts)."""
    history = [{"role": "system", "content": system}]
    cached, served, texts = [], [], []
    with Client(endpoint, timeout=60) as c:
        for user in users:
            history.append({"role": "user", "content": user})
            before = prompt_tokens(replicas) if replicas else None
            out = c.generate(messages=history, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, cache_salt=salt)
            served.append(served_by(replicas, before) if replicas else None)
            cached.append(out.usage.cached_tokens)
            texts.append(out.text)
            history.append({"role": "assistant", "content": out.text})
    return cached, served, texts


@contextmanager
def serve_in_thread(r, timeout: float = 30.0) -> Iterator:
    """Binds router r (router.router.Router or a subclass), serves it on a daemon thread until the block ends, and
    yields it once every replica is up and its index synced; then stops, joins and closes it."""
    r.bind()
    stop = threading.Event()
    thread = threading.Thread(target=r.serve, args=(lambda: not stop.is_set(),), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not all(rep.up and not rep.index.syncing for rep in r.replicas):
            assert time.monotonic() < deadline, "replicas not in rotation"
            time.sleep(0.05)
        yield r
    finally:
        stop.set()
        thread.join(10)
        r.close()
        r.ctx.term()
