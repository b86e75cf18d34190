"""What this CPU can do, read at run time, and the dtype `--dtype auto` picks from it.

The development machines differ: some CPUs have AVX2 only, others AVX-512 with AVX512-BF16 or AMX-BF16, where
oneDNN's bfloat16 matmuls run faster than float32 (benchmarks/decode_throughput.py measures by how much). Nothing here
is assumed at import or build time: the flags come from /proc/cpuinfo (Linux) when asked.

For tests only: $RADIXSERVE_CPU_FLAGS (CPU_FLAGS_ENV), when set, replaces the CPU's flags with its space-separated
list (read by cpu_flags alone, at each call, and inherited by the server's processes), so that both decisions of
`--dtype auto` run end to end on any host. It changes no kernel torch picks: only what this module reports.
"""

from __future__ import annotations

import functools
import os
import platform

import torch

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # native bfloat16 dot products (AMX tiles, or AVX-512 VDPBF16PS)
REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
CPU_FLAGS_ENV = "RADIXSERVE_CPU_FLAGS"  # tests only: the flags cpu_flags() reports instead of the CPU's
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo's first processor (empty where the file is missing: not Linux), or the
    space-separated flags of $RADIXSERVE_CPU_FLAGS when it is set (tests only; see the module docstring)."""
    override = os.environ.get(CPU_FLAGS_ENV)
    if override is not None:
        return frozenset(override.split())
    return _proc_cpu_flags()


@functools.cache
def _proc_cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else platform.processor(), else "unknown"."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True if the CPU multiplies bfloat16 natively (any of BF16_FLAGS); flags default to cpu_flags()."""
    return any(f in (cpu_flags() if flags is None else flags) for f in BF16_FLAGS)


def resolve_dtype(dtype: str, device: str | torch.device, flags: frozenset[str] | None = None) -> torch.dtype:
    """The torch dtype of ServerArgs.dtype on device: "auto" is bfloat16 on CUDA and on CPUs with native bfloat16
    (has_native_bf16), float32 on other CPUs; any other name maps to itself.

    Raises: KeyError for a name outside auto / float32 / bfloat16 / float16 (ServerArgs' Literal rules it out).
    """
    if dtype != "auto":
        return _DTYPES[dtype]
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if has_native_bf16(flags) else torch.float32


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one, else os.cpu_count())."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_facts() -> dict[str, object]:
    """What a benchmark records beside its figures: CPU model, torch's cpu capability, the flags that matter,
    usable cores, load average (1, 5, 15 min), torch threads."""
    return {
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "flags": [f for f in REPORTED_FLAGS if f in cpu_flags()],
        "native_bf16": has_native_bf16(),
        "cores": usable_cores(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
