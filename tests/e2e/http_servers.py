"""HTTP servers for the e2e tests: a launcher started with --http-port (LaunchedHttp, start_http_server: both ready
lines read from its stdout), a standalone `python -m runtime.serve.http` in front of a running server (HttpProcess,
start_http), and raw HTTP helpers.

start_http_server runs `python -m <module> --model MODEL --port 0 --http-port 0 FLAGS` (runtime.launch or
router.launch) and returns once the launcher printed its ready line, after the HTTP child's
"radixserve http ready at http://HOST:PORT".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.processes import stop_process
from tests.e2e.servers import exact_flags
from tests.paths import ROOT


@dataclass
class LaunchedHttp:
    """A launcher subprocess, its ZeroMQ endpoint and its HTTP base URL; stop() sends SIGINT and waits."""

    proc: subprocess.Popen
    endpoint: str
    url: str
    log: Path

    def stop(self, timeout: float = 20.0) -> int:
        return stop_process(self.proc, timeout)


def start_http_server(
    model: str,
    log: Path,
    *flags: str,
    module: str = "runtime.launch",
    env: dict[str, str] | None = None,
    timeout: float = 300.0,
) -> LaunchedHttp:
    """Starts the launcher with --http-port 0 (servers.exact_flags) and waits for its two ready lines; RuntimeError
    with the log's tail when it exits first. env: the whole environment of the launcher (default: this process's)."""
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    launch_flags = exact_flags(flags) if module == "runtime.launch" else list(flags)
    cmd = [sys.executable, "-m", module, "--model", model, "--port", "0", "--http-port", "0", *launch_flags]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    assert proc.stdout is not None
    url = endpoint = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not endpoint:
        line = proc.stdout.readline()
        if line.startswith("radixserve http ready at "):
            url = line.split()[-1]
        elif line.startswith(("radixserve ready at ", "radixserve router ready at ")):
            endpoint = line.split()[-1]
        elif not line and proc.poll() is not None:
            break
    if endpoint and url:
        return LaunchedHttp(proc, endpoint, url, log)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"server did not start (url {url!r}); log:\n{log.read_text()[-4000:]}")


def http(
    method: str, url: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 60.0
) -> tuple[int, bytes]:
    """(status, body bytes) of one request; body: a JSON-able object or None."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET url/metrics parsed: (sample name, sorted labels) -> value. Asserts a 200."""
    status, body = http("GET", url + "/metrics", headers=headers)
    assert status == 200, body[:300]
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


MODEL = "tiny"  # the served model name of the tiny server behind start_http


@dataclass
class HttpProcess:
    """A `python -m runtime.serve.http` subprocess; url is http://HOST:PORT. stop() sends SIGINT and waits."""

    proc: subprocess.Popen
    url: str
    log: Path

    def openai(self, api_key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    def async_openai(self, api_key: str = "none") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def stop(self, timeout: float = 20.0) -> int:
        return stop_process(self.proc, timeout)


def start_http(backend: str, log: Path, *flags: str, env: dict | None = None, timeout: float = 120.0) -> HttpProcess:
    """Starts `python -m runtime.serve.http --backend <backend> --port 0 <flags>` and waits for its ready line."""
    cmd = [sys.executable, "-m", "runtime.serve.http", "--backend", backend, "--port", "0", *flags]
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("radixserve http ready at "):
            return HttpProcess(proc, line.split()[-1], log)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"http server did not start; log:\n{log.read_text()[-4000:]}")


def start_tiny_http(
    tiny_server, tiny_llama_dir: Path, log_dir: Path, *flags: str, env: dict | None = None
) -> HttpProcess:
    """start_http in front of the e2e tiny_server, serving the tiny model folder under the name MODEL; log in
    log_dir/http.log; flags and env as start_http's."""
    cmd_flags = ("--model", str(tiny_llama_dir), "--served-model-name", MODEL, *flags)
    return start_http(tiny_server.endpoint, log_dir / "http.log", *cmd_flags, env=env)


def assert_idle(zmq, wait_idle) -> None:
    """The server behind the ZeroMQ client zmq runs and waits for nothing and holds no block (wait_idle: the
    e2e fixture)."""
    stats = wait_idle(zmq)
    assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0)
    assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_blocks - 1


def salt() -> str:
    return uuid.uuid4().hex


def msgs(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]
