"""End-to-end fixtures: real launcher, worker, scheduler and tokenizer processes on 127.0.0.1.

Servers are session-scoped (start-up costs seconds): `tiny_server` serves the tiny random Llama of tests/conftest.py
(2 layers, the SmolLM2 tokenizer, context 1024) for protocol, cache and lifecycle tests; `smol_server` serves the
embedded SmolLM2-135M where real text matters; both run in float32, since their tests compare the outputs of
separate requests. Tests that kill a server start their own with the `launch` fixture (the default dtype).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.http_servers import start_tiny_http
from tests.e2e.servers import TINY_FLAGS, Server, start_server, wait_until_idle


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny random Llama of tests/conftest.py (context 1024 tokens, vocab 49152) behind a real server.

    Its worker runs one torch thread: the tiny model decodes 1000 tokens in about a second, and with the worker's
    threads on every core (the default) the HTTP and tokenizer processes can wait that long for a core, which the
    tests that abort a running request race against (seen about 1 run in 10 on 2 cores)."""
    server = start_server(
        str(tiny_llama_dir), tmp_path_factory.mktemp("logs") / "tiny.log", *TINY_FLAGS, env={"RADIXSERVE_THREADS": "1"}
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smol_server(tmp_path_factory: pytest.TempPathFactory):
    server = start_server(
        "smollm2",
        tmp_path_factory.mktemp("logs") / "smol.log",
        "--num-blocks",
        "256",
        "--max-running-requests",
        "16",
        "--dtype",
        "float32",
    )
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
    return wait_until_idle


@pytest.fixture(scope="module")
def http(tiny_server, tiny_llama_dir, tmp_path_factory):
    """A `python -m runtime.serve.http` in front of tiny_server, serving the model name MODEL; one per module."""
    server = start_tiny_http(tiny_server, tiny_llama_dir, tmp_path_factory.mktemp("logs"))
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def oai(http):
    """The openai SDK's client of the module's HTTP server."""
    with http.openai() as client:
        yield client


@pytest.fixture(scope="module")
def zmq(tiny_server):
    """A ZeroMQ Client of tiny_server, the reference the HTTP answers are compared with."""
    with tiny_server.client() as c:
        yield c
