"""Real servers for the e2e tests: a launcher subprocess (`python -m runtime.launch`) started and waited for, the
tiny model's flags, and waiting until a server is idle."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.client import Client
from tests.e2e.processes import children, stop_process
from tests.paths import ROOT

# float32: tests of these servers compare outputs of separate requests, cached with uncached (bfloat16 is measured
# against float32 in tests/runtime/test_bf16_agreement.py; the servers the lifecycle tests launch run the default).
TINY_FLAGS = [
    "--num-blocks",
    "1024",
    "--block-size",
    "16",
    "--max-prefill-tokens",
    "512",
    "--chunked-prefill-size",
    "256",
    "--log-interval-s",
    "1",
    "--max-message-bytes",
    "65536",
    "--dtype",
    "float32",
]


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
        for pid in children(self.proc.pid):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            for role in ("worker", "scheduler", "tokenizer"):
                if any(f'"role":"{role}"'.encode() in part for part in cmd):
                    out[role] = pid
        return out

    def stop(self, timeout: float = 20.0) -> int:
        return stop_process(self.proc, timeout)


def exact_flags(flags: tuple[str, ...]) -> list[str]:
    """flags, with `--quantization none` unless they set it: the servers' tests compare outputs token for token with
    transformers and with each other, while `auto` (the default) runs a GGUF's 4-bit tensors int4 (its agreement is
    measured in tests/runtime/model/test_quant_agreement.py)."""
    if "--quantization" in flags:
        return list(flags)
    return [*flags, "--quantization", "none"]


def start_server(
    model: str, log: Path, *flags: str, timeout: float = 300.0, env: dict[str, str] | None = None
) -> Server:
    """Starts `python -m runtime.launch --model <model> --port 0 <flags>` (environment: ours + env; exact_flags) and
    waits for its ready line."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "runtime.launch", "--model", model, "--port", "0", *exact_flags(flags)]
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


def wait_until_idle(client: Client, timeout_s: float = 10.0):
    """Polls stats until no request runs or waits and no block is used; returns the last ServerStats."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)
