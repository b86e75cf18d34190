"""Start, stop and failure of the whole server; the launch flags; the one-line cause of every start-up failure; the demo
script and the IPC benchmark's smoke mode."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest

from runtime import protocol as p
from runtime.client import ServerFailedError
from runtime.config import ServerArgs
from runtime.serve.launch import build_parser
from runtime.serve.process import ChildSpec, Endpoints
from tests.paths import ROOT


def alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids, timeout_s: float = 20.0) -> list[int]:
    """Polls until none of pids is alive (or the timeout); returns those still alive."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def child_endpoints(pid: int) -> Endpoints:
    """The Endpoints of a child process, read from the ChildSpec JSON on its command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return msgspec.json.decode(argv[argv.index(b"--child") + 1], type=ChildSpec).endpoints


def run_launcher(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runtime.launch", *flags], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def start_up_failure(stderr: str) -> str:
    """The cause in the launcher's one "start-up failed: <cause>" log line (exactly one such line)."""
    [line] = [line for line in stderr.splitlines() if "start-up failed: " in line]
    return line.split("start-up failed: ", 1)[1]


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (clock ticks)


def test_every_server_arg_is_a_flag():
    parser = build_parser()
    dests = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(ServerArgs)} <= dests
    ns = parser.parse_args(
        [
            "--no-enable-prefix-caching",
            "--num-blocks",
            "64",
            "--schedule-policy",
            "lpm",
            "--preemption-mode",
            "swap",
            "--kv-cache-memory",
            "1048576",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "256",
            "--host",
            "0.0.0.0",
        ]
    )
    assert (ns.enable_prefix_caching, ns.num_blocks, ns.schedule_policy, ns.preemption_mode) == (
        False,
        64,
        "lpm",
        "swap",
    )
    assert (ns.kv_cache_memory, ns.dtype, ns.max_model_len, ns.host) == (1048576, "bfloat16", 256, "0.0.0.0")
    defaults = parser.parse_args([])
    assert defaults.enable_prefix_caching is True and defaults.num_blocks is None and defaults.port == 5557
    assert (defaults.dtype, defaults.quantization) == ("auto", "auto")
    with pytest.raises(SystemExit):
        parser.parse_args(["--schedule-policy", "random"])


def test_idle_server_uses_almost_no_cpu(tiny_server):
    with tiny_server.client() as c:
        assert c.health() == "ok"
    pids = [tiny_server.proc.pid, *tiny_server.child_pids().values()]
    assert len(pids) == 4
    hz = os.sysconf("SC_CLK_TCK")
    before = [cpu_ticks(pid) for pid in pids]
    time.sleep(3.0)
    used_s = sum(cpu_ticks(pid) - b for pid, b in zip(pids, before, strict=True)) / hz
    assert used_s <= 0.15  # 4 processes over 3 s: at most 5% of one core together


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_leaves_no_process(tiny_llama_dir, launch, sig):
    server = launch(str(tiny_llama_dir), "--num-blocks", "64")
    children = server.child_pids()
    assert sorted(children) == ["scheduler", "tokenizer", "worker"]
    server.proc.send_signal(sig)
    assert server.proc.wait(30) == 0
    assert wait_gone(children.values()) == []


def test_killed_launcher_fails_the_stream_and_leaves_nothing_behind(tiny_llama_dir, launch):
    """kill -9 of the launcher mid-stream: the client gets the tokenizer's ServerFailedError (not its own liveness
    timeout's ServerGoneError), every server process is gone within 5 s, and no socket name or file of the server is
    left (abstract-namespace ipc endpoints)."""
    server = launch(str(tiny_llama_dir), "--num-blocks", "64")
    children = server.child_pids()
    endpoints = child_endpoints(children["worker"])
    name = endpoints.base.removeprefix("@")
    assert endpoints.base == "@" + name and name.startswith("radixserve-")
    assert [getattr(endpoints, f) for f in Endpoints.__struct_fields__] == [
        f"ipc://@{name}/{f}" for f in ("launcher", "worker_in", "worker_out", "scheduler_in", "tokenizer_in", "events")
    ]
    assert f"@{name}/worker_in" in Path("/proc/net/unix").read_text()
    with server.client(timeout=60) as c:
        stream = c.stream(input_ids=[1, 2, 3], ignore_eos=True, temperature=0.0, max_tokens=1000)
        next(stream)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        with pytest.raises(ServerFailedError) as info:
            for _ in stream:
                pass
    assert info.type is ServerFailedError
    assert (info.value.code, info.value.message) == (p.ERR_SERVER, "the launcher died")
    assert wait_gone(children.values(), timeout_s=5.0) == []
    assert name not in Path("/proc/net/unix").read_text()
    assert not (Path(tempfile.gettempdir()) / name).exists()


def test_stopped_server_leaves_no_socket_name(tiny_llama_dir, launch):
    server = launch(str(tiny_llama_dir), "--num-blocks", "64")
    name = child_endpoints(server.child_pids()["scheduler"]).base.removeprefix("@")
    assert f"@{name}/scheduler_in" in Path("/proc/net/unix").read_text()
    assert server.stop() == 0
    assert name not in Path("/proc/net/unix").read_text()
    assert not (Path(tempfile.gettempdir()) / name).exists()


def test_killed_worker_fails_clients_and_launcher_exits_nonzero(tiny_llama_dir, launch):
    server = launch(str(tiny_llama_dir), "--num-blocks", "64")
    children = server.child_pids()
    with server.client(timeout=30) as c:
        stream = c.stream(input_ids=[1, 2, 3], ignore_eos=True, temperature=0.0, max_tokens=1000)
        next(stream)
        os.kill(children["worker"], signal.SIGKILL)
        with pytest.raises(ServerFailedError) as info:
            for _ in stream:
                pass
    assert "worker" in info.value.message
    assert server.proc.wait(30) == 1
    assert wait_gone(children.values()) == []


def test_out_of_range_flag_is_a_usage_error():
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.launch", "--block-size", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "block_size must be a power of two, got 3" in proc.stderr


def test_port_in_use_exits_nonzero(tiny_server, tiny_llama_dir):
    port = tiny_server.endpoint.rsplit(":", 1)[1]
    proc = run_launcher("--model", str(tiny_llama_dir), "--port", port, "--num-blocks", "16")
    assert proc.returncode == 1
    assert start_up_failure(proc.stderr) == (
        f"tokenizer process failed to start: cannot bind tcp://127.0.0.1:{port}: Address already in use"
    )


def test_events_port_in_use_names_the_cause(tiny_llama_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_launcher(
            "--model", str(tiny_llama_dir), "--port", "0", "--num-blocks", "16", "--events-port", str(port)
        )
    assert proc.returncode == 1
    assert start_up_failure(proc.stderr) == (
        f"scheduler process failed to start: cannot bind events_port tcp://127.0.0.1:{port}: Address already in use"
    )


def test_model_that_fails_to_load_exits_nonzero(tmp_path):
    proc = run_launcher("--model", str(tmp_path / "missing"), "--port", "0")
    assert proc.returncode == 1
    assert start_up_failure(proc.stderr).startswith(
        f"worker process failed to start: ModelNotFoundError: model "
        f"'{tmp_path / 'missing'}' not found (no such folder or file); "
    )


def test_kv_pool_under_four_blocks_names_the_cause(tiny_llama_dir):
    proc = run_launcher("--model", str(tiny_llama_dir), "--port", "0", "--kv-cache-memory", "10")
    assert proc.returncode == 1
    assert start_up_failure(proc.stderr).startswith(
        "worker process failed to start: InvalidConfig: KV pool of 0 usable blocks (kv_cache_memory 10 bytes, "
    )


def test_demo_script_runs_on_a_tiny_model(tiny_llama_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runtime.demo",
            "--model",
            str(tiny_llama_dir),
            "--max-tokens",
            "6",
            "--conversations",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^\s+(\d) +(\d) +(\d+) +(\d+) +[\d.]+$", proc.stdout, re.M)
    assert [(int(c), int(t)) for c, t, _, _ in rows] == [(1, 1), (2, 1), (1, 2), (2, 2), (1, 3), (2, 3)]
    prompt = {(int(c), int(t)): int(p) for c, t, p, _ in rows}
    cached = {(int(c), int(t)): int(k) for c, t, _, k in rows}
    assert cached[(1, 1)] == 0
    assert cached[(2, 1)] >= 64  # the shared system prompt
    for turn in (2, 3):  # the previous turn's prompt, whole blocks
        for conv in (1, 2):
            assert cached[(conv, turn)] >= prompt[(conv, turn - 1)] // 16 * 16
    assert "conversation 2, turn 3" in proc.stdout


def test_ipc_overhead_smoke():
    from benchmarks.ipc_overhead import main

    out = main(["--smoke"])
    rows = out["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(8, 64), (8, 256)]
    assert all(r["us_per_step"] > 0 for r in rows)
    # the step message grows with the batch, not the context (only wider integers for larger positions)
    assert rows[1]["bytes_per_step"] <= rows[0]["bytes_per_step"] * 1.2
