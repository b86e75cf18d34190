"""Stopping a server process the tests started: SIGINT (a clean shutdown), then SIGKILL after a timeout."""

from __future__ import annotations

import signal
import subprocess


def stop_process(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    """SIGINT proc if it still runs, wait up to timeout seconds, else SIGKILL it; returns its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
