"""Watching a load benchmark's server: its stats once idle, each process's RSS and its stats sampled over the run,
and the machine's facts saved with the results. Shared by benchmarks/soak.py and benchmarks/http_load.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
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
