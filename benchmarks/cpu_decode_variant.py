"""A copy of the CPU decode kernel (kernels/cpu_decode.cpp and .h) built under its own operator namespace, so that two
versions, or two builds (-march=native, -march=x86-64-v3), run side by side in one process.

``load_variant("base", *git_source(BASE_COMMIT))`` is the kernel as it was before the query heads of a KV group
shared each K/V row (one query row at a time); benchmarks/attention_gqa_cpu.py times it against the current kernel
and tests/kernels/test_cpu_decode_gqa.py checks that both give the same bits. A variant's library is cached like the
kernel's own (kernels.cpp_build: keyed by its source, flags, torch and machine), so only the first call compiles.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from kernels import cpp_build, cpu_decode

# The last commit whose kernel computed the query heads of a KV head one after another.
BASE_COMMIT = "8d69656234a5e4c55c7535cb67054289f97e9434"
ROOT = Path(__file__).resolve().parents[1]
NATIVE = cpu_decode.CFLAGS  # the flags the kernel itself is built with
AVX2 = ("-O3", "-march=x86-64-v3", "-fopenmp")  # W = 8 vectors (cpu_decode.h) on an AVX-512 machine too


def git_source(commit: str) -> tuple[bytes, bytes]:
    """kernels/cpu_decode.cpp and kernels/cpu_decode.h at ``commit``. Raises subprocess.CalledProcessError without
    git or the commit (a checkout with no history)."""

    def show(name: str) -> bytes:
        cmd = ["git", "show", f"{commit}:kernels/{name}"]
        return subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True).stdout

    return show("cpu_decode.cpp"), show("cpu_decode.h")


def tree_source() -> tuple[bytes, bytes]:
    """kernels/cpu_decode.cpp and kernels/cpu_decode.h as they are in this checkout."""
    return cpu_decode.SOURCE.read_bytes(), cpu_decode.HEADER.read_bytes()


def renamed(source: bytes, namespace: str) -> bytes:
    """``source`` with its operator library (radixserve) and C++ namespace (radixserve_cpu) renamed after
    ``namespace``, so it loads beside the kernel. Raises ValueError if the source names neither any more."""
    out = source.replace(b"radixserve_cpu", f"{namespace}_cpu".encode())
    for macro in (b"TORCH_LIBRARY(", b"TORCH_LIBRARY_IMPL("):
        out = out.replace(macro + b"radixserve,", macro + namespace.encode() + b",")
    if out == source:
        raise ValueError("the kernel source names neither radixserve_cpu nor the radixserve library")
    return out


def load_variant(tag: str, cpp: bytes, header: bytes, cflags: tuple[str, ...] = NATIVE) -> Callable[..., torch.Tensor]:
    """torch.ops.radixserve_<tag>.paged_decode built from ``cpp`` and ``header`` with ``cflags``: the same arguments
    and result as torch.ops.radixserve.paged_decode. Compiles on the first call on this machine (into
    kernels.cpp_build.cache_dir()); a tag loads once per process (a second call with other sources returns the
    first). Raises what the build or the load raises."""
    namespace = f"radixserve_{tag}"
    ops = getattr(torch.ops, namespace)
    if not hasattr(ops, "paged_decode"):
        cpp, header = renamed(cpp, namespace), renamed(header, namespace)
        folder = Path(tempfile.mkdtemp(prefix=f"{namespace}-"))
        try:
            (folder / "cpu_decode.cpp").write_bytes(cpp)
            (folder / "cpu_decode.h").write_bytes(header)
            # the helper's protocol (declarations only: a variant links nothing of it), for sources that include it
            (folder / "cpu_share.h").write_bytes(cpu_decode.SHARE_HEADER.read_bytes())
            headers = (folder / "cpu_decode.h", folder / "cpu_share.h")
            op_source = cpp_build.OpSource(namespace, (folder / "cpu_decode.cpp", *headers), cflags)

            def build(path: Path) -> None:
                cpp_build.compile_library(path, [folder / "cpu_decode.cpp"], cflags)

            cpp_build.load_library(op_source.library_path(), build)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return ops.paged_decode
