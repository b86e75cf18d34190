"""HTTP overhead: TTFT of a short prompt at idle through the OpenAI HTTP server vs the ZeroMQ client, same server.

Starts one server (`python -m runtime.launch --model M --port 0`) and the HTTP server in front of it
(`python -m runtime.serve.http --backend <its endpoint> --port 0`), then alternates, one request at a time, three
clients on the same short completions prompt (max_tokens 1, greedy, so the first token is the whole answer):
  zmq       runtime.client.Client.stream: send -> the first StreamChunk with tokens
  http      a raw HTTP/1.1 keep-alive connection (http.client), stream: true: send -> the first `data: {` event
            (the server's own overhead: routing, JSON, SSE, one more ZeroMQ hop inside one host)
  openai    the openai SDK's stream on a keep-alive connection: send -> the first chunk (what a user sees; includes
            the SDK's own parsing)
Reports p50 / p90 / mean (ms) of each, overhead_ms = http p50 - zmq p50 and openai p50 - zmq p50, and the target
(http p50 <= zmq p50 + 3 ms), with the machine facts (CPU model, torch CPU capability, cores, load average before
and after).

    .venv/bin/python -m benchmarks.http_overhead                 # smollm2, 200 rounds -> results/http_overhead.json
    .venv/bin/python -m benchmarks.http_overhead --smoke --model <tiny model folder> --out /tmp/http.json  # seconds
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from benchmarks.cli import write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "http_overhead.json"
PROMPT = "The capital of France is"
TARGET_MS = 3.0


def _start(cmd: list[str], ready: str, log: Path, timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    """Starts cmd, waits for the stdout line starting with ready; returns (process, the line's last word)."""
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(ready):
            return proc, line.split()[-1]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{cmd[2]} did not start; log:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ttft_zmq(client: Any) -> float:
    t0 = time.perf_counter()
    first = None
    for chunk in client.stream(prompt=PROMPT, max_tokens=1, temperature=0.0):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t0
    assert first is not None
    return first


def ttft_http(conn: http.client.HTTPConnection, model: str) -> float:
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0, "stream": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first = None
    while first is None:
        line = resp.readline()
        assert line, "the stream ended without a chunk"
        if line.startswith(b"data: {"):
            first = time.perf_counter() - t0
    resp.read()  # the rest of the stream ([DONE]), so the connection is reused
    return first


def ttft_openai(client: Any, model: str) -> float:
    t0 = time.perf_counter()
    first = None
    for _ in client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0.0, stream=True):
        if first is None:
            first = time.perf_counter() - t0
    assert first is not None
    return first


def summary(values_s: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values_s)
    return {
        "p50_ms": statistics.median(ms),
        "p90_ms": ms[int(0.9 * (len(ms) - 1))],
        "mean_ms": statistics.fmean(ms),
        "n": len(ms),
    }


def measure(endpoint: str, url: str, model: str, rounds: int, warmup: int) -> dict[str, list[float]]:
    """rounds of (zmq, http, openai) TTFTs in seconds, alternating, after warmup rounds of each."""
    import openai

    from runtime.client import Client

    u = urllib.parse.urlsplit(url)
    out: dict[str, list[float]] = {"zmq": [], "http": [], "openai": []}
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=60)
    with Client(endpoint, timeout=60) as zmq, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as oai:
        for i in range(warmup + rounds):
            got = {"zmq": ttft_zmq(zmq), "http": ttft_http(conn, model), "openai": ttft_openai(oai, model)}
            if i >= warmup:
                for name, value in got.items():
                    out[name].append(value)
    conn.close()
    return out


def run(model: str, rounds: int, warmup: int, logs: Path) -> dict[str, Any]:
    logs.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    server, endpoint = _start(
        [sys.executable, "-m", "runtime.launch", "--model", model, "--port", "0"],
        "radixserve ready at ",
        logs / "server.log",
    )
    try:
        front, url = _start(
            [
                sys.executable,
                "-m",
                "runtime.serve.http",
                "--backend",
                endpoint,
                "--port",
                "0",
                "--model",
                model,
                "--served-model-name",
                "bench",
            ],
            "radixserve http ready at ",
            logs / "http.log",
        )
        try:
            samples = measure(endpoint, url, "bench", rounds, warmup)
        finally:
            _stop(front)
    finally:
        _stop(server)
    stats = {name: summary(values) for name, values in samples.items()}
    overhead = stats["http"]["p50_ms"] - stats["zmq"]["p50_ms"]
    return {
        "model": model,
        "prompt": PROMPT,
        "rounds": rounds,
        "warmup": warmup,
        "ttft": stats,
        "overhead_ms": {"http": overhead, "openai": stats["openai"]["p50_ms"] - stats["zmq"]["p50_ms"]},
        "target": {"http_p50_le_zmq_p50_plus_ms": TARGET_MS, "met": overhead <= TARGET_MS},
        "machine": {**_machine_facts(), "load_before": list(load_before), "load_after": list(os.getloadavg())},
        "command": " ".join(["python -m benchmarks.http_overhead", *sys.argv[1:]]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="5 rounds, 2 warm-up; writes nothing unless --out")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/http_overhead_logs"))
    ns = parser.parse_args(argv)
    rounds, warmup = (5, 2) if ns.smoke else (ns.rounds, ns.warmup)
    result = run(ns.model, rounds, warmup, ns.logs)
    write_result(result, ns.out, ns.smoke, RESULTS)
    ttft = result["ttft"]
    print(
        f"TTFT p50: zmq {ttft['zmq']['p50_ms']:.2f} ms, http {ttft['http']['p50_ms']:.2f} ms, openai SDK "
        f"{ttft['openai']['p50_ms']:.2f} ms; overhead {result['overhead_ms']['http']:+.2f} ms "
        f"(target <= +{TARGET_MS} ms: {'met' if result['target']['met'] else 'MISSED'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _machine_facts() -> dict:
    """runtime.model.cpu_features.machine_facts (imported here: only the benchmark process loads torch)."""
    from runtime.model.cpu_features import machine_facts

    return machine_facts()
