"""A launcher started with --http-port, for the HTTP tests: both ready lines read from its stdout, raw HTTP helpers.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from processes import stop_process
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class HttpServer:
    """A launcher subprocess, its ZeroMQ endpoint and its HTTP base URL; stop() sends SIGINT and waits."""

    proc: subprocess.Popen
    endpoint: str
    url: str
    log: Path

    def stop(self, timeout: float = 20.0) -> int:
        return stop_process(self.proc, timeout)


def start_http_server(model: str, log: Path, *flags: str, module: str = "runtime.launch",
                      env: dict[str, str] | None = None, timeout: float = 300.0) -> HttpServer:
    """Starts the launcher with --http-port 0 and waits for its two ready lines; RuntimeError with the log's tail
    when it exits first. env: the whole environment of the launcher (default: this process's)."""
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", module, "--model", model, "--port", "0", "--http-port", "0", *flags]
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
        return HttpServer(proc, endpoint, url, log)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"server did not start (url {url!r}); log:\n{log.read_text()[-4000:]}")


def http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
         timeout: float = 60.0) -> tuple[int, bytes]:
    """(status, body bytes) of one request; body: a JSON-able object or None."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
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


def descendants(pid: int) -> list[int]:
    """Every live process below pid (children, grandchildren, ...), Linux /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
