"""Hostile connections against the HTTP server, and streams under load through the router (issue 28): the trial's
figures, measured on the code of --root (default: this checkout; `--root /work/main` measures the code before).

Starts two replicas of --model (`python -m runtime.launch`), a router in front of both (`python -m router.launch`,
its default health settings) and an HTTP server in front of the first replica (`python -m runtime.serve.http`) under
`prlimit --nofile=FD_LIMIT`, then measures:
  fd_limit      --idle TCP connections to the HTTP server that send nothing, held open; then how long GET /health
                takes (None: no answer within 5 s) while they are held, and again after the header timeout
                (HEADER_WAIT_S), with how many of them the server had closed by then
  big_header    one request with a --big-header-mib MiB header: its status and seconds, and the slowest of the
                GET /v1/models probes another connection sent every 50 ms meanwhile
  many_headers  one request with --small-headers headers of 8 bytes: its status, seconds, and the HTTP process's
                resident memory growth (MiB) after it
  router_load   --streams concurrent streams (max_tokens --max-tokens, greedy, ignore_eos) through the router:
                how many failed, and why
with the machine facts (runtime.model.cpu_features.machine_facts).

    .venv/bin/python -m benchmarks.hostile_http                      # smollm2 -> results/hostile_http.json
    .venv/bin/python -m benchmarks.hostile_http --root /work/main --out /tmp/hostile_before.json
    .venv/bin/python -m benchmarks.hostile_http --smoke --model <tiny model folder> --out /tmp/h.json  # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from benchmarks.cli import apply_preset, output_path
from runtime.client import Client, ClientError
from runtime.model.cpu_features import machine_facts

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "hostile_http.json"
HEADER_WAIT_S = 12.0  # past the default 10 s header timeout
SMOKE = {"fd_limit": 256, "idle": 300, "big_header_mib": 1, "small_headers": 10_000, "streams": 4, "max_tokens": 8}
REPLICA_FLAGS = ["--port", "0", "--events-port", "0", "--num-blocks", "512", "--dtype", "float32"]


def _start(cmd: list[str], root: Path, ready: str, log: Path, timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    """Starts cmd in root; waits for the stdout line starting with ready; returns (process, the line's last word)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(root), "RADIXSERVE_LOG_LEVEL": "WARNING"}
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(ready):
            return proc, line.split()[-1]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{cmd} did not start; log:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(2)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _address(url: str) -> tuple[str, int]:
    u = urllib.parse.urlsplit(url)
    assert u.hostname is not None and u.port is not None
    return u.hostname, u.port


def get_seconds(url: str, path: str, timeout: float = 5.0) -> float | None:
    """Seconds until GET path answers 200 on a new connection; None when it does not within timeout."""
    start = time.monotonic()
    try:
        with socket.create_connection(_address(url), timeout=timeout) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            head = sock.recv(64)
    except OSError:
        return None
    return time.monotonic() - start if head.startswith(b"HTTP/1.1 200") else None


def send_request(url: str, head: bytes, timeout: float = 120.0) -> tuple[int | None, float]:
    """(status or None, seconds) of one raw request (its request line and headers, then an empty line)."""
    start = time.monotonic()
    status = None
    try:
        with socket.create_connection(_address(url), timeout=timeout) as sock:
            try:
                sock.sendall(head + b"\r\n")
            except OSError:
                pass  # answered and closed before it was all sent
            line = sock.recv(64)
            status = int(line.split()[1]) if line.startswith(b"HTTP/") else None
    except OSError:
        pass
    return status, time.monotonic() - start


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def fd_limit(url: str, idle: int) -> dict[str, Any]:
    """Holds idle connections that send nothing; /health while they are held, and after the header timeout."""
    held = []
    for _ in range(idle):
        try:
            held.append(socket.create_connection(_address(url), timeout=1.0))
        except OSError:
            break
    time.sleep(0.5)
    during = get_seconds(url, "/health")
    time.sleep(HEADER_WAIT_S)
    closed = 0
    for sock in held:
        sock.setblocking(False)
        try:
            closed += sock.recv(1024) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    after = get_seconds(url, "/health")
    for sock in held:
        sock.close()
    return {"connected": len(held), "health_during_s": during, "closed_by_server": closed, "health_after_s": after}


def big_header(url: str, mib: int) -> dict[str, Any]:
    """One request with a header of mib MiB, while another connection probes /v1/models every 50 ms."""
    probes: list[float | None] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            probes.append(get_seconds(url, "/v1/models"))
            time.sleep(0.05)

    thread = threading.Thread(target=probe)
    thread.start()
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (mib << 20) + b"\r\n"
    status, seconds = send_request(url, head)
    done.set()
    thread.join()
    slowest = max((p for p in probes if p is not None), default=None)
    return {"mib": mib, "status": status, "seconds": seconds, "slowest_probe_s": slowest, "probes": len(probes)}


def many_headers(url: str, pid: int, count: int) -> dict[str, Any]:
    """One request with count headers of 8 bytes each; the HTTP process's RSS growth after it."""
    before = rss_mib(pid)
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"X-a: b\r\n" * count
    status, seconds = send_request(url, head)
    time.sleep(1.0)
    return {"headers": count, "status": status, "seconds": seconds, "rss_growth_mib": rss_mib(pid) - before}


def router_load(endpoint: str, streams: int, max_tokens: int) -> dict[str, Any]:
    """streams concurrent streams through the router; how many failed and why."""
    errors: list[str] = []
    tokens: list[int] = []

    def one(i: int) -> None:
        try:
            with Client(endpoint, timeout=600) as c:
                n = 0
                for chunk in c.stream(
                    prompt=f"Story {i}: once upon a time", max_tokens=max_tokens, temperature=0.0, ignore_eos=True
                ):
                    n += len(chunk.token_ids)
                tokens.append(n)
        except ClientError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "streams": streams,
        "failed": len(errors),
        "errors": sorted(set(errors)),
        "complete": sum(n == max_tokens for n in tokens),
        "seconds": time.monotonic() - start,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose servers are measured")
    parser.add_argument("--fd-limit", type=int, default=1024, help="RLIMIT_NOFILE of the HTTP server")
    parser.add_argument("--idle", type=int, default=1100, help="idle connections held")
    parser.add_argument("--big-header-mib", type=int, default=32)
    parser.add_argument("--small-headers", type=int, default=1_000_000)
    parser.add_argument("--streams", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="seconds-long run (small figures)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--logs", type=Path, default=Path("/tmp"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.smoke:
        apply_preset(parser, ns, SMOKE)
    root = ns.root.resolve()
    procs: list[subprocess.Popen] = []
    try:
        replicas = []
        for i in range(2):
            cmd = [sys.executable, "-m", "runtime.launch", "--model", ns.model, *REPLICA_FLAGS]
            proc, endpoint = _start(cmd, root, "radixserve ready at ", ns.logs / f"hostile_replica{i}.log")
            procs.append(proc)
            replicas.append(endpoint)
        cmd = [
            sys.executable,
            "-m",
            "router.launch",
            "--model",
            ns.model,
            "--port",
            "0",
            "--backends",
            ",".join(replicas),
        ]
        proc, router = _start(cmd, root, "radixserve router ready at ", ns.logs / "hostile_router.log")
        procs.append(proc)
        http_cmd = ["prlimit", f"--nofile={ns.fd_limit}:{ns.fd_limit}", sys.executable, "-m", "runtime.serve.http"]
        http_cmd += ["--backend", replicas[0], "--port", "0", "--model", ns.model]
        http, url = _start(http_cmd, root, "radixserve http ready at ", ns.logs / "hostile_http.log")
        procs.append(http)
        result = {
            "root": str(root),
            "commit": subprocess.run(
                ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip(),
            "model": ns.model,
            "fd_limit": {"limit": ns.fd_limit, **fd_limit(url, ns.idle)},
            "big_header": big_header(url, ns.big_header_mib),
            "many_headers": many_headers(url, http.pid, ns.small_headers),
            "router_load": router_load(router, ns.streams, ns.max_tokens),
            "http_alive": http.poll() is None and get_seconds(url, "/v1/models") is not None,
            "machine": machine_facts(),
        }
    finally:
        for proc in reversed(procs):
            _stop(proc)
    print(json.dumps(result, indent=2))
    out = output_path(ns.out, ns.smoke, RESULTS)
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
