"""Holding a server's decoding still, so a test that aborts a running request does not race the model's speed.

frozen(worker_pid(server)) stops the worker process (SIGSTOP) for a with block: no step runs, so a request cannot
reach max_tokens, whatever the machine's speed or load, until the block ends (SIGCONT). Look the pid up before the
request starts: freezing is then one system call after the event the test waited for. The scheduler keeps answering
stats and applying aborts meanwhile (it polls the tokenizer while a step is in flight), so a test waits for the event
it caused (wait_stats: the request gone from the running set) instead of sleeping. At most the step in flight when the
worker stopped comes back after it continues, and the scheduler drops its results for aborted sequences
(Scheduler.process_result).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator

from runtime.client import Client
from runtime.protocol import ServerStats
from tests.e2e.servers import Server


def worker_pid(server: Server) -> int:
    """The pid of server's worker process (a scan of /proc)."""
    return server.child_pids()["worker"]


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """SIGSTOP process pid for the with block; SIGCONT after it, error or not."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_stats(client: Client, done: Callable[[ServerStats], bool], what: str, timeout_s: float = 30.0) -> ServerStats:
    """client.stats() polled until done(stats) holds; returns those stats. Fails the test with `what` after
    timeout_s seconds."""
    deadline = time.monotonic() + timeout_s
    stats = client.stats()
    while not done(stats):
        assert time.monotonic() < deadline, f"{what} (after {timeout_s} s; last stats {stats})"
        time.sleep(0.01)
        stats = client.stats()
    return stats
