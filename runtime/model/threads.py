"""The worker's torch intra-op thread count: every usable core by default, or $RADIXSERVE_THREADS.

Every core by default because the scheduler and tokenizer processes sleep in poll while the worker computes, so the
forward has the cores to itself. On a machine whose cores other jobs keep busy the opposite holds: a descheduled
thread stalls every parallel op of the forward, and fewer threads run faster; set RADIXSERVE_THREADS there.
benchmarks/step_breakdown.py measures both counts side by side.
"""

from __future__ import annotations

import os

import torch

from runtime.config import InvalidConfig
from runtime.model.cpu_features import usable_cores

THREADS_ENV = "RADIXSERVE_THREADS"  # overrides the worker's torch intra-op threads: an integer >= 1


def cpu_threads(cores: int, torch_threads: int, env: str | None) -> int:
    """The worker's torch intra-op threads: the integer in env ($RADIXSERVE_THREADS) when set, else
    min(torch_threads, cores) (torch_threads: torch's default, the physical cores or OMP_NUM_THREADS).

    Raises InvalidConfig when env is set and not an integer >= 1.
    """
    if env is None or not env.strip():
        return max(1, min(torch_threads, cores))
    threads = 0
    if env.strip().isdecimal():
        threads = int(env)
    if threads < 1:
        raise InvalidConfig(f"{THREADS_ENV}={env!r}: expected an integer >= 1")
    return threads


def set_cpu_threads() -> int:
    """Set torch's intra-op threads to cpu_threads(usable cores, torch's count, $RADIXSERVE_THREADS); returns the
    count. Mutates torch's process-wide setting. Raises InvalidConfig for a malformed RADIXSERVE_THREADS."""
    threads = cpu_threads(usable_cores(), torch.get_num_threads(), os.environ.get(THREADS_ENV))
    torch.set_num_threads(threads)
    return threads
