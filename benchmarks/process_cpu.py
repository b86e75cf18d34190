"""Where a single stream's CPU time goes, process by process: the worker (its main thread apart from its other
threads: the qgemv op's helper, ZeroMQ's I/O thread), the scheduler, the tokenizer, the HTTP server, and this process
(the HTTP client and the launcher).

Starts one server of --model with the defaults and its HTTP API (benchmarks.qgemv_helper.server), streams one warm-up
completion, then `--runs` completions of `--tokens` tokens one after another (benchmarks/chat/single_stream.py,
greedy, EOS ignored), and reads each process's user + system CPU time (psutil) before and after. Reported per output
token: wall_ms (the runs' wall clock over their tokens), cpu_ms per process and per worker thread group, and
frontend_ms (scheduler + tokenizer + http: the work a 2-core machine runs beside the decode step, on the core the
helper would use). The figures read as shares of one run; the VM's speed drifts between runs.

    .venv/bin/python -m benchmarks.process_cpu --model smollm2     # 3 x 256 tokens -> results/process_cpu.json
    .venv/bin/python -m benchmarks.process_cpu --smoke --model <tiny model folder>   # seconds; writes nothing
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.chat.single_stream import stream_completion
from benchmarks.cli import apply_preset, write_result
from benchmarks.qgemv_helper import PROMPT, server
from runtime.model.cpu_features import machine_facts

RESULTS = Path(__file__).parent / "results" / "process_cpu.json"
SMOKE = {"runs": 1, "tokens": 16}
ROLE = re.compile(r'"role":\s*"(\w+)"')  # a child's role in its ChildSpec JSON argument (runtime/serve/process.py)
FRONTENDS = ("scheduler", "tokenizer", "http")


def role_of(proc: psutil.Process) -> str | None:
    """The server role ("worker", "scheduler", ...) a child process was started for, None for any other process."""
    match = ROLE.search(" ".join(proc.cmdline()))
    return match.group(1) if match else None


def cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    """User + system CPU seconds of each named process so far; for "worker", also "worker_main" (its main thread,
    which runs the decode steps) and "worker_other" (every other thread). Raises psutil.Error when one has exited."""
    out = {}
    for name, proc in procs.items():
        times = proc.cpu_times()
        out[name] = times.user + times.system
        if name == "worker":
            main = sum(t.user_time + t.system_time for t in proc.threads() if t.id == proc.pid)
            out["worker_main"] = main
            out["worker_other"] = out[name] - main
    return out


def measure(url: str, model: str, runs: int, tokens: int) -> dict[str, Any]:
    """Streams runs completions of tokens tokens from url and returns wall_ms and each process's cpu_ms per output
    token (see the module docstring). Raises BenchmarkError as stream_completion."""
    me = psutil.Process()
    procs = {"benchmark": me}
    for child in me.children(recursive=True):
        role = role_of(child)
        if role is not None:
            procs[role] = child
    stream_completion(url, model, PROMPT, 16)  # warm-up
    before = cpu_seconds(procs)
    start = time.perf_counter()
    done = sum(stream_completion(url, model, PROMPT, tokens).tokens for _ in range(runs))
    wall = time.perf_counter() - start
    after = cpu_seconds(procs)
    cpu_ms = {name: round((after[name] - before[name]) / done * 1e3, 3) for name in before}
    return {
        "tokens": done,
        "wall_ms": round(wall / done * 1e3, 3),
        "cpu_ms": cpu_ms,
        "frontend_ms": round(sum(cpu_ms.get(name, 0.0) for name in FRONTENDS), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="embedded name or model folder")
    parser.add_argument("--runs", type=int, default=3, help="completions timed, one after another")
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per completion")
    parser.add_argument("--smoke", action="store_true", help="seconds: 1 completion of 16 tokens, writes nothing")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON path (default {RESULTS})")
    args = parser.parse_args(argv)
    if args.smoke:
        apply_preset(parser, args, SMOKE)
    with server(args.model) as url:
        per_token = measure(url, args.model, args.runs, args.tokens)
    result = {"model": args.model, "runs": args.runs, "machine": machine_facts(), **per_token}
    print(result)
    write_result(result, args.out, args.smoke, RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
