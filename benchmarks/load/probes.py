"""Watching a load benchmark's server: its stats once idle, each process's RSS and its stats sampled over the run,
and the machine's facts saved with the results. Shared by benchmarks/soak.py and benchmarks/http_load.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import time
from pathlib import Path
from typing import Any

import msgspec


def read_rss_kb(pid: int) -> int | None:
    """VmRSS of pid in kB (None when the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


async def sample(
    endpoint: str,
    pids: dict[str, int],
    t_start: float,
    rss: dict[str, list],
    stats: list,
    interval_s: float,
    stop: asyncio.Event,
) -> None:
    """Every interval_s until stop: [t_s, kB] per role into rss, and {t_s, ServerStats fields} into stats."""
    from runtime.client import AsyncClient

    async with AsyncClient(endpoint, timeout=60.0) as client:
        while True:
            t = round(time.monotonic() - t_start, 1)
            for role, pid in pids.items():
                rss[role].append([t, read_rss_kb(pid)])
            stats.append({"t_s": t, **msgspec.structs.asdict(await client.stats())})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            if stop.is_set():
                return


async def wait_idle(endpoint: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """The server's stats once no request runs, waits or is swapped (or after timeout_s), as a dict."""
    from runtime.client import AsyncClient

    async with AsyncClient(endpoint, timeout=60.0) as client:
        end = time.monotonic() + timeout_s
        while True:
            stats = await client.stats()
            if (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0) or time.monotonic() > end:
                return msgspec.structs.asdict(stats)
            await asyncio.sleep(0.2)


def machine_facts() -> dict[str, Any]:
    """CPU model, torch's CPU capability, cores, Python, platform (torch is imported here, in the benchmark only)."""
    import torch

    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": model,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
