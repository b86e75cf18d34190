"""The processes the tests start: stopping one (SIGINT, a clean shutdown, then SIGKILL after a timeout) and finding
its children and descendants (Linux /proc)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path


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


def children(pid: int) -> list[int]:
    """pids whose parent is pid (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
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


def role_pids(launcher_pid: int) -> dict[str, int]:
    """role ("worker", "scheduler", "tokenizer", "http") -> pid of a launcher's children (their ChildSpec JSON on
    the command line names the role)."""
    out = {}
    for pid in descendants(launcher_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        for role in ("worker", "scheduler", "tokenizer", "http"):
            if f'"role":"{role}"'.encode() in cmd:
                out[role] = pid
    return out
