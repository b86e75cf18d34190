"""A crash of any server process with HTTP streams in flight (issue 28, class 4): every stream gets an error event
and `data: [DONE]` within a second of the kill, whichever process died (a test per process: tokenizer, scheduler,
worker), from a launcher with --http-port.

Before: a scheduler or worker crash was answered at once (the tokenizer errors every request in flight), but a
tokenizer crash cut every stream with neither: nothing told the HTTP process's AsyncClient that its backend had gone
(its liveness clock waits 15 s), the launcher then sent the HTTP child SIGTERM, uvicorn waited for the streams (5 s
of graceful shutdown) and the launcher killed it after its own 3 s grace. The AsyncClient now watches its socket
and fails every request in flight the moment the connection to the server drops."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.parse
from http.client import HTTPConnection

import pytest

from tests.e2e.http_servers import start_http_server
from tests.e2e.processes import role_pids
from tests.e2e.servers import TINY_FLAGS

STREAMS = 4
BODY = {"prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "temperature": 0.0, "stream": True}


class Stream:
    """One streamed completion read on its own thread: its events, and when [DONE] (or the end) arrived."""

    def __init__(self, url: str) -> None:
        u = urllib.parse.urlsplit(url)
        self.conn = HTTPConnection(u.hostname, u.port, timeout=30)
        self.conn.request("POST", "/v1/completions", json.dumps(BODY), {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self.events: list[str] = []
        self.first = threading.Event()
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for raw in self.resp:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.first.set()
                    if line == "data: [DONE]":
                        break
        except OSError:
            pass
        self.ended_at = time.monotonic()
        self.first.set()

    @property
    def error(self) -> dict | None:
        errors = [json.loads(e)["error"] for e in self.events if e.startswith('{"error"')]
        return errors[0] if errors else None


@pytest.mark.slow
@pytest.mark.parametrize("role", ["tokenizer", "scheduler", "worker"])
def test_a_crash_ends_every_stream_with_an_error_and_done(role, tiny_llama_dir, tmp_path):
    server = start_http_server(str(tiny_llama_dir), tmp_path / "server.log", *TINY_FLAGS)
    try:
        pid = role_pids(server.proc.pid)[role]
        streams = [Stream(server.url) for _ in range(STREAMS)]
        for s in streams:
            assert s.first.wait(30)
        assert all(s.ended_at is None for s in streams), "a stream ended before the kill"
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for s in streams:
            s.thread.join(10)
        for s in streams:
            assert s.events[-1] == "[DONE]", s.events[-3:]
            assert s.error is not None and s.error["code"] in ("server_error", "backend_unavailable"), s.events[-3:]
            assert s.ended_at is not None and s.ended_at - killed < 1.0, s.ended_at - killed
    finally:
        server.stop()
