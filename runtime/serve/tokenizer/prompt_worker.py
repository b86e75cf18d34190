"""PromptWorker: the tokenizer process's one tokenizing thread, so a large prompt never stalls the process loop.

Tokenizing a prompt of max_prompt_chars characters, or rendering a chat template, takes a sizeable fraction of a
second on a small CPU; on the loop thread, a few such prompts in a row would stop heartbeats and every other client's
stream for longer than that (the README gives the measured gaps). transformers' `tokenizer.encode` releases the GIL
inside the Rust encoder (it goes through encode_batch), so with the encode on this thread the loop keeps running; the
raw `backend_tokenizer.encode` does not release it, so jobs must call the transformers methods. Pure-Python work on
this thread (the chat template, the prompt check) yields the GIL every sys.getswitchinterval().

Jobs are queued per group (a client's identity) and run one at a time, taking the groups in turn: a group's jobs
run in submission order (a client's requests are forwarded in the order they came), and one client's queue of large
prompts delays another client's prompt by one job at most. The thread touches no socket: each result goes on a queue
and one byte into a pipe whose read end the loop polls beside its sockets (zmq.Poller takes a file descriptor).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)


class PromptResult(NamedTuple):
    """A finished job: key and group as submitted; value is what the job returned, or error the exception it raised.
    A cancelled job's result has value None and error None."""

    key: str
    group: Hashable
    value: Any
    error: Exception | None


def run_job(key: str, group: Hashable, job: Callable[[], Any]) -> PromptResult:
    """job() as a PromptResult: its value, or the exception it raised (the owner answers the request with it)."""
    try:
        return PromptResult(key, group, job(), None)
    except Exception as exc:
        return PromptResult(key, group, None, exc)


class PromptWorker:
    """A daemon thread running submitted jobs (groups in turn, each group's in order); results are collected on the
    owner's thread.

    fd: the read end of the wake-up pipe; readable while results wait (register it with zmq.Poller).
    in_flight: jobs submitted and not yet collected. Owner-side methods (submit, cancel, busy, results, wait, close)
    are called from one owner thread only.
    """

    def __init__(self, name: str = "prompt-worker") -> None:
        self._cond = threading.Condition()
        self._queues: dict[Hashable, deque[tuple[str, Callable[[], Any]]]] = {}  # group -> its queued jobs
        self._turns: deque[Hashable] = deque()  # groups with queued jobs, in turn order
        self._results: queue.SimpleQueue[PromptResult] = queue.SimpleQueue()
        self._cancelled: set[str] = set()
        self._closed = False
        self._busy: dict[Hashable, int] = {}  # group -> jobs not yet collected (owner thread only)
        self.in_flight = 0
        read_fd, write_fd = os.pipe()
        self.fd = read_fd  # readable when a result is ready: the loop polls it
        self._wake_fd = write_fd
        os.set_blocking(self.fd, False)
        os.set_blocking(self._wake_fd, False)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: str, group: Hashable, job: Callable[[], Any]) -> None:
        """Queues job() to run on the worker thread after the group's earlier jobs. O(1)."""
        self.in_flight += 1
        self._busy[group] = self._busy.get(group, 0) + 1
        with self._cond:
            if group not in self._queues:
                self._queues[group] = deque()
                self._turns.append(group)
            self._queues[group].append((key, job))
            self._cond.notify()

    def cancel(self, key: str) -> None:
        """A job not started yet will not run (its result still comes, with value None); one running finishes."""
        self._cancelled.add(key)

    def busy(self, group: Hashable) -> bool:
        """True while a job of group is queued, running, or its result is not collected yet."""
        return group in self._busy

    def results(self) -> list[PromptResult]:
        """Every result finished so far, groups interleaved as they ran; never blocks. Empties the wake-up pipe."""
        try:
            while os.read(self.fd, 4096):
                pass
        except OSError:  # BlockingIOError: empty
            pass
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                break
        for result in out:
            self._collected(result)
        return out

    def wait(self, timeout_s: float) -> list[PromptResult]:
        """Results, waiting up to timeout_s seconds for every submitted job to finish (for in-process drivers)."""
        deadline = time.monotonic() + timeout_s
        out = self.results()
        while self.in_flight:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                result = self._results.get(timeout=left)
            except queue.Empty:
                break
            self._collected(result)
            out.append(result)
            out += self.results()
        return out

    def close(self) -> None:
        """Stops the thread after the job it runs (queued jobs are dropped) and closes the read end; the thread closes
        the write end as it exits, so no fd number is written to after its reuse."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        try:
            os.close(self.fd)
        except OSError:
            pass

    def _collected(self, result: PromptResult) -> None:
        self.in_flight -= 1
        self._cancelled.discard(result.key)
        left = self._busy.get(result.group, 1) - 1
        if left:
            self._busy[result.group] = left
        else:
            self._busy.pop(result.group, None)

    def _next(self) -> tuple[str, Hashable, Callable[[], Any]] | None:
        """The next job, the groups taken in turn; None once closed."""
        with self._cond:
            while not self._turns and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            group = self._turns.popleft()
            jobs = self._queues[group]
            key, job = jobs.popleft()
            if jobs:
                self._turns.append(group)
            else:
                del self._queues[group]
            return key, group, job

    def _run(self) -> None:
        try:
            while True:
                item = self._next()
                if item is None:
                    return
                key, group, job = item
                cancelled = key in self._cancelled
                self._results.put(PromptResult(key, group, None, None) if cancelled else run_job(key, group, job))
                try:
                    os.write(self._wake_fd, b"\0")
                except BlockingIOError:
                    pass  # the pipe is full: the owner is woken anyway
                except OSError:
                    return  # the owner closed the read end
        finally:
            os.close(self._wake_fd)
