"""Fused CPU paged decode attention (kernels/cpu_decode.cpp): build on first use, load, dispatch rule.

The operator ``torch.ops.radixserve.paged_decode`` reads each sequence's K/V blocks in place through its block table
(float32 or bfloat16 caches), so the decode path needs no gather into a workspace (the reference's index_select). It
runs on torch's intra-op thread pool (at::parallel_for), so ``torch.set_num_threads`` governs it and no second pool
competes with torch's.

Build: kernels.cpp_build compiles it on first use into ``$RADIXSERVE_CACHE/kernels`` as
``radixserve_cpu_decode-<key>.so`` (key: source, compiler, flags, torch, machine: -march=native ties the binary to
this CPU), once across concurrent processes. A build or load failure logs one warning and ``load_op`` returns None:
the torch path stays in use.

``python -m kernels.cpu_decode`` builds it (if needed) and prints where and how long. Set ``RADIXSERVE_CPU_DECODE=0``
(read once, at import) or ``ENABLED = False`` to turn the kernel off. ``RADIXSERVE_CPU_DECODE_CFLAGS`` (read at import)
adds compiler flags, e.g. ``-mno-avx512f`` to build and test the AVX2 variant on an AVX-512 machine.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kernels import cpp_build
from kernels.errors import KernelInputError

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
HEADER = Path(__file__).with_name("cpu_decode.h")  # included by SOURCE: part of the build key
SHARE_HEADER = Path(__file__).with_name("cpu_share.h")  # the helper's protocol (share_helper): part of the key too
NAME = "radixserve_cpu_decode"
# -fopenmp turns on at::parallel_for's OpenMP backend (inline in ATen's headers; without it the loop runs serially).
# The link adds no -lgomp: GOMP_* resolve to the runtime libtorch_cpu already loaded, so there is one thread pool.
CFLAGS = ("-O3", "-march=native", "-fopenmp", *os.environ.get("RADIXSERVE_CPU_DECODE_CFLAGS", "").split())
ENABLED = os.environ.get("RADIXSERVE_CPU_DECODE", "1") != "0"
DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 256  # the kernel holds a row in at most MAX_NC vectors (cpu_decode.h): head_dim <= 256

_op: Callable[..., torch.Tensor] | None = None  # torch.ops.radixserve.paged_decode once loaded
_failed = False  # a build or load failed in this process (warned once; the torch path stays in use)


Built = cpp_build.Built
cache_dir = cpp_build.cache_dir
compiler = cpp_build.compiler


def source_bytes() -> bytes:
    """The kernel's source as built: SOURCE and the headers it includes."""
    return b"\0".join(path.read_bytes() for path in (SOURCE, HEADER, SHARE_HEADER))


def library_path(source: bytes) -> Path:
    """Path of the library built from ``source`` by compiler() with CFLAGS against this torch, on this machine."""
    return cpp_build.library_path(NAME, source, CFLAGS)


def _compile(path: Path) -> None:
    """Build SOURCE into ``path`` (cpp_build.compile_library) and load it into this process."""
    cpp_build.compile_library(path, [SOURCE], CFLAGS)


def ensure_built(path: Path, compile_fn: Callable[[Path], None] = _compile) -> Built:
    """cpp_build.ensure_built with this kernel's build as the default compile_fn."""
    return cpp_build.ensure_built(path, compile_fn)


def load_op() -> Callable[..., torch.Tensor] | None:
    """torch.ops.radixserve.paged_decode, building it on first use; None (one warning per process) if it cannot be
    built or loaded. The operator can be registered once per process: the first library loaded stays."""
    global _op, _failed
    if _op is not None or _failed:
        return _op
    try:
        if not _registered():
            cpp_build.load_library(library_path(source_bytes()), _compile)
        _op = torch.ops.radixserve.paged_decode
    except Exception as exc:  # any build or load failure (compiler, linker, loader) keeps the torch path
        detail = "\n".join(str(exc).strip().splitlines()[-6:])  # a failed build's message ends with the compiler's
        logger.warning("CPU decode kernel unavailable (%s); using the torch path: %s", compiler(), detail)
        _failed = True
    return _op


def share_helper() -> bool:
    """Lets paged_decode share its work items with the qgemv op's helper thread (kernels/cpu_share.h) whenever that
    is on and torch runs one thread: hands this op the qgemv library's share_work and helper_on (kernels/cpu_decode.cpp,
    "Threads"). Builds either op on first use; returns False (nothing linked) when either is unavailable. The output
    is the same bits shared or not. Mutates process-wide state."""
    from kernels import cpu_qgemv

    if load_op() is None or cpu_qgemv.load_op() is None:
        return False
    share_work, helper_on = torch.ops.radixserve_qgemv.helper_entry()
    torch.ops.radixserve.link_helper(share_work, helper_on)
    return True


def _registered() -> bool:
    """True if this process already has the operator (from an earlier load: it cannot be registered twice)."""
    return hasattr(torch.ops.radixserve, "paged_decode")


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True if the kernel may run these inputs: ENABLED, float32 or bfloat16 CPU tensors of one dtype, contiguous
    caches, q rows with a contiguous head_dim that is a multiple of 16 up to MAX_HEAD_DIM; does not build the
    kernel."""
    return (
        ENABLED
        and q.device.type == "cpu"
        and q.dtype in DTYPES
        and q.dtype == k_cache.dtype == v_cache.dtype
        and q.shape[-1] % 16 == 0
        and q.shape[-1] <= MAX_HEAD_DIM
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and q.stride(-1) == 1
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """Decode attention, one query token per sequence, read in place from the paged cache.

    Args:
        q: float32 or bfloat16 [num_seqs, num_heads, head_dim] (head_dim contiguous), CPU.
        k_cache, v_cache: contiguous [num_blocks, block_size, num_kv_heads, head_dim], dtype of q.
        block_tables: int32 or int64 [num_seqs, >= blocks needed]; entry j of row i is sequence i's j-th block.
        seq_lens: int32 or int64 [num_seqs], tokens of each sequence, the new token included (0 gives zeros).
        scale: softmax scale (usually head_dim ** -0.5).
        sliding_window: W tokens, or None / 0 for full attention: the query at position L - 1 sees the keys at
            L - W .. L - 1 only (kernels.paged_attention's rule), and the blocks before them are never read.

    Returns:
        [num_seqs, num_heads, head_dim], dtype of q, a new contiguous tensor (scores, softmax and accumulation in
        float32); None if the kernel could not be built (the caller takes the torch path). Runs on
        torch.get_num_threads() threads of torch's pool, or on one shared with the qgemv op's helper thread
        (share_helper); sequences may come in any order. Mutates nothing.

    Raises:
        KernelInputError: a block table too narrow for a sequence, a block id outside the cache, or shapes/dtypes
            the kernel does not take (checked before any work).
    """
    op = _op if _op is not None else load_op()
    if op is None:
        return None
    try:
        return op(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window or 0)
    except ValueError as exc:  # c10::ValueError from the operator's input checks
        raise KernelInputError(str(exc).split("\n", 1)[0]) from exc


def main() -> None:
    """Build the kernel (if needed) and print where it is and how long the build took."""
    start = time.perf_counter()
    built = ensure_built(library_path(source_bytes()))
    if not built.built:
        torch.ops.load_library(str(built.path))
    verb = f"built in {built.seconds:.1f} s" if built.built else "already built"
    print(f"{built.path}: {verb}; loaded after {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
