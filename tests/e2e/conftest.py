"""End-to-end fixtures: real launcher, worker, scheduler and tokenizer processes on 127.0.0.1.

Servers are session-scoped (start-up costs seconds): `tiny_server` serves the tiny random Llama of tests/conftest.py
(2 layers, the SmolLM2 tokenizer, context 1024) for protocol, cache and lifecycle tests; `smol_server` serves the
embedded SmolLM2-135M where real text matters; both run in float32, since their tests compare the outputs of
separate requests. Tests that kill a server start their own with the `launch` fixture (the default dtype).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from processes import stop_process

from runtime.client import Client

ROOT = Path(__file__).resolve().parents[2]
# float32: tests of these servers compare outputs of separate requests, cached with uncached (bfloat16 is measured
# against float32 in tests/runtime/test_bf16_agreement.py; the servers the lifecycle tests launch run the default).
TINY_FLAGS = ["--num-blocks", "1024", "--block-size", "16", "--max-prefill-tokens", "512",
              "--chunked-prefill-size", "256", "--log-interval-s", "1",
              "--max-message-bytes", "65536", "--dtype", "float32"]


@dataclass
class Server:
    """A launcher subprocess and its public endpoint; stop() sends SIGINT (Ctrl-C) and waits."""

    proc: subprocess.Popen
    endpoint: str
    log: Path

    def client(self, timeout: float = 60.0) -> Client:
        return Client(self.endpoint, timeout=timeout)

    def child_pids(self) -> dict[str, int]:
        """pid of each live child of the launcher, by the role in its command line."""
        out = {}
        for pid in descendants(self.proc.pid):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            for role in ("worker", "scheduler", "tokenizer"):
                if any(f'"role":"{role}"'.encode() in part for part in cmd):
                    out[role] = pid
        return out

    def stop(self, timeout: float = 20.0) -> int:
        return stop_process(self.proc, timeout)


def descendants(pid: int) -> list[int]:
    """pids whose parent is pid (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def start_server(model: str, log: Path, *flags: str, timeout: float = 300.0, env: dict[str, str] | None = None
                 ) -> Server:  # fmt: skip
    """Starts `python -m runtime.launch --model <model> --port 0 <flags>` (environment: ours + env) and waits for its
    ready line."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "runtime.launch", "--model", model, "--port", "0", *flags]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("radixserve ready at "):
            return Server(proc, line.split()[-1], log)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"server did not start; log:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny random Llama of tests/conftest.py (context 1024 tokens, vocab 49152) behind a real server.

    Its worker runs one torch thread: the tiny model decodes 1000 tokens in about a second, and with the worker's
    threads on every core (the default) the HTTP and tokenizer processes can wait that long for a core, which the
    tests that abort a running request race against (seen about 1 run in 10 on 2 cores)."""
    server = start_server(str(tiny_llama_dir), tmp_path_factory.mktemp("logs") / "tiny.log", *TINY_FLAGS,
                          env={"RADIXSERVE_THREADS": "1"})
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smol_server(tmp_path_factory: pytest.TempPathFactory):
    server = start_server("smollm2", tmp_path_factory.mktemp("logs") / "smol.log", "--num-blocks", "256",
                          "--max-running-requests", "16", "--dtype", "float32")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def server_factory():
    """start_server(model, log, *flags) -> Server, for a module-scoped server on a model folder a test builds (the
    caller stops it)."""
    return start_server


@pytest.fixture
def launch(tmp_path: Path):
    """start_server(model, *flags) for tests that stop or kill their own server; stopped at teardown."""
    servers: list[Server] = []

    def _launch(model: str, *flags: str) -> Server:
        servers.append(start_server(model, tmp_path / f"server{len(servers)}.log", *flags))
        return servers[-1]

    yield _launch
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def wait_idle():
    """wait_idle(client, timeout_s) -> ServerStats once nothing runs, waits or holds a block (or at the timeout)."""
    return _wait_idle


def _wait_idle(client: Client, timeout_s: float = 10.0):
    """Polls stats until no request runs or waits and no block is used; returns the last ServerStats."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)
